# swarm: one image for `swarm coordinator`, `swarm worker` and `swarm flower`.
# Secrets (model key, Redis password, Flower login) come from the environment at run
# time (`env_file: .env` in docker-compose.yml, or `docker run --env-file .env`), never
# from the image: .dockerignore keeps .env out of the build context.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Agents run shell commands with bash, in bubblewrap (with libseccomp's filter), with a
# network of their own from slirp4netns (routes by iproute2, port rules by nftables);
# children may work in git worktrees.
RUN apt-get update \
 && apt-get install -y --no-install-recommends bash git ca-certificates procps \
      bubblewrap libseccomp2 slirp4netns iproute2 nftables \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY swarm ./swarm
RUN pip install . && rm -rf /src

# Non-root; SWARM_HOME (children's workspaces, hints, logs) is the `workspaces` volume.
RUN useradd --create-home --uid 10001 --shell /bin/bash swarm \
 && mkdir -p /var/lib/swarm \
 && chown swarm:swarm /var/lib/swarm
USER swarm
ENV SWARM_HOME=/var/lib/swarm
WORKDIR /var/lib/swarm

ENTRYPOINT ["swarm"]
CMD ["--help"]
