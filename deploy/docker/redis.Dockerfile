# Redis from Debian's packages, for machines that reach no image registry (the host-network compose
# overlay and the Kubernetes test overlay use it in place of redis:7-alpine):
#   podman build --format docker --network=host -f deploy/docker/redis.Dockerfile \
#     --build-arg BASE_IMAGE=localhost/debian-minbase:bookworm -t localhost/baton-redis:0.1.0 deploy/docker
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*
# nobody: with nothing persisted Redis writes no file
USER 65534:65534
WORKDIR /tmp
EXPOSE 6379
# the registry holds heartbeats with a TTL: nothing to persist
HEALTHCHECK --interval=5s --timeout=3s --retries=12 CMD ["redis-cli", "ping"]
CMD ["redis-server", "--save", "", "--appendonly", "no"]
