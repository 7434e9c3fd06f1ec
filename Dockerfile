# scaffold on PyTorch's CUDA image. Build and run (needs the NVIDIA container toolkit):
#   docker build -t scaffold .
#   docker run --gpus all --rm -v "$PWD/outputs:/app/outputs" scaffold                  # scale 7 benchmark
#   docker run --gpus all --rm scaffold python -m scaffold.train scale=8 epochs=5
# The -devel flavour carries the C compiler Triton needs to build its kernel launchers at run time.
ARG BASE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel
FROM ${BASE}
WORKDIR /app
COPY pyproject.toml README.md ./
COPY scaffold ./scaffold
COPY conf ./conf
COPY data ./data
# torch and triton come with the base image (torch>=2.11 is already satisfied); install the rest.
RUN pip install --no-cache-dir '.[plots]'
CMD ["python", "-m", "scaffold.train", "scale=7"]
