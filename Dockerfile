# scaffold on PyTorch's CUDA image. Build and run (needs the NVIDIA container toolkit):
#   docker build -t scaffold .
#   docker run --gpus all --rm -v "$PWD/outputs:/app/outputs" -v "$HOME/.cache/scaffold:/root/.cache/scaffold" \
#       scaffold                                                   # scale 7 benchmark
#   docker run --gpus all --rm -v "$PWD/outputs:/app/outputs" -v "$HOME/.cache/scaffold:/root/.cache/scaffold" \
#       scaffold python -m scaffold.train scale=8 epochs=5
# The two mounts keep the run directories and the generated datasets (data.cache_dir's default,
# ~/.cache/scaffold, is /root/.cache/scaffold in the container) after the container is gone, so the next
# run reuses the dataset instead of generating it again. Create them first (mkdir -p outputs
# ~/.cache/scaffold): Docker creates a missing one owned by root.
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
