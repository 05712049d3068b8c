# sglang-pacer in front of real SGLang workers, on a GPU host.
#
# Built on SGLang's official image, which already holds SGLang, CUDA torch and the kernels; this
# package is added without touching them (its own dependencies are small: aiohttp, uvloop, orjson,
# httptools, nvidia-ml-py, prometheus-client). The supervisor launches workers with the image's
# `python3 -m sglang.launch_server`, so proxy and workers share the container and its GPUs.
#
#   docker build -t sglang-pacer .
#   docker run --gpus all --ipc=host --shm-size 16g -p 8000:8000 \
#     -v $PWD/policies/h100-llama-3.1-8b.toml:/etc/pacer/policy.toml:ro \
#     -v $HOME/.cache/huggingface:/root/.cache/huggingface -e HF_TOKEN \
#     -e PACER_API_KEYS -e PACER_ADMIN_KEY sglang-pacer
ARG SGLANG_TAG=v0.5.23
FROM lmsysorg/sglang:${SGLANG_TAG}

WORKDIR /opt/sglang-pacer
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY policies ./policies
# No [sglang] extra: the image's SGLang and torch stay as they are. The image installs into its
# system Python; PIP_BREAK_SYSTEM_PACKAGES lets a PEP 668 base do the same (older pips ignore it).
# For workers on a Ray cluster (fleet.backend = "ray", proxy and Ray nodes alike):
#   docker build --build-arg PACER_EXTRAS="[fleet]" -t sglang-pacer .
#   (PACER_EXTRAS="[fleet,postgres]" for a PostgreSQL store that several replicas share: [store] url)
ARG PACER_EXTRAS=""
RUN PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir ".${PACER_EXTRAS}" \
    && mkdir -p /etc/pacer /var/log/pacer

# Mount the policy at /etc/pacer/policy.toml (the copies in /opt/sglang-pacer/policies are examples);
# worker logs and the decision journal go to /var/log/pacer.
VOLUME ["/var/log/pacer"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s \
    CMD python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
ENTRYPOINT []
CMD ["pacer", "serve", "--policy", "/etc/pacer/policy.toml"]
