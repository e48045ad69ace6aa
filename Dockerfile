# jaxbatch on CPU: the OpenAI-compatible server on port 8000.
#   docker build -t jaxbatch-cpu .
#   docker run -p 8000:8000 -v $HOME/.cache/jaxbatch:/cache jaxbatch-cpu
#   docker run -p 8000:8000 -v /models:/models jaxbatch-cpu --model /models/model.gguf
# The C++ kernels are built at the first start with the machine's instruction set (g++ stays in
# the image for that; kept under /cache, so a volume there keeps them, the model and the
# start-up measurements between restarts). deploy/kubernetes/ runs this image.
FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ curl \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/jaxbatch
COPY pyproject.toml README.md ./
COPY jaxbatch ./jaxbatch
COPY pallas_kernels ./pallas_kernels
COPY configs ./configs
RUN pip install --no-cache-dir . \
    && useradd --create-home --uid 1000 jaxbatch \
    && mkdir -p /cache && chown jaxbatch /cache

USER jaxbatch
ENV JAXBATCH_CACHE=/cache
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s \
    CMD curl -fsS http://127.0.0.1:8000/health || exit 1
ENTRYPOINT ["jaxbatch", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--config", "configs/smollm2-cpu.yaml"]
