# scaffold on an NVIDIA CUDA PyTorch image. Build and run:
#   docker build -t scaffold .
#   docker run --gpus all --rm -v $PWD/outputs:/app/outputs scaffold            # scale 7 benchmark
#   docker run --gpus all --rm scaffold python -m scaffold.train scale=8 epochs=5
FROM nvcr.io/nvidia/pytorch:25.10-py3
WORKDIR /app
COPY pyproject.toml README.md ./
COPY scaffold ./scaffold
COPY conf ./conf
COPY data ./data
# The base image already carries torch and triton; install only what it lacks.
RUN pip install --no-cache-dir -e '.[plots]'
CMD ["python", "-m", "scaffold.train", "scale=7"]
