# syntax=docker/dockerfile:1
# runfeed: multi-stage, multi-platform build (linux/amd64 and linux/arm64). The builder compiles
# the release binaries with the locked dependency set; the runtime image (the last stage, the
# default target) is Debian slim with the server binary, CA certificates and a non-root user. The
# `demo` stage carries only the development workload `runfeed-demo` (crates/runfeed-dev), for
# docker-compose.yml's demo.
#   docker build -t runfeed .                      # the image for this machine's platform
#   docker buildx build --platform linux/amd64,linux/arm64 \
#     --build-arg RUNFEED_BUILD_COMMIT="$(git rev-parse HEAD)" -t <registry>/runfeed:<version> --push .
#   docker build --target demo -t runfeed-demo .
#   docker run --rm -p 3030:3030 -e DATABASE_URL=… -e REDIS_URL=… runfeed
# The builder runs on the build machine's platform (BUILDPLATFORM) and cross-compiles for each
# target platform (TARGETARCH), and the runtime stages run no command of their own, so an arm64
# image builds on an amd64 machine (and the reverse) without emulating the other CPU. Image tags
# and how to pin a release: docs/releases.md. tests/deploy/deploy.rs checks this file statically
# (cargo test --test deploy).

FROM --platform=$BUILDPLATFORM rust:1.95-bookworm AS builder
# Set by BuildKit (docker buildx, or docker build with BuildKit): the platform the image is for
# and the one building it.
ARG TARGETARCH
ARG BUILDARCH
WORKDIR /src
# The Rust target, its C cross toolchain (jemalloc is C) and jemalloc's page size for TARGETARCH,
# written to /cross.env for the build step. arm64 kernels run with 4, 16 or 64 KiB pages, and a
# jemalloc built for smaller pages than the kernel's aborts at start ("Unsupported system page
# size"), so arm64 gets jemalloc's 64 KiB page (lg 16), which runs on all three.
RUN set -eu; \
    case "$TARGETARCH" in \
      amd64) triple=x86_64-unknown-linux-gnu; gnu=x86_64-linux-gnu; gcc=gcc-x86-64-linux-gnu; lg_page=12 ;; \
      arm64) triple=aarch64-unknown-linux-gnu; gnu=aarch64-linux-gnu; gcc=gcc-aarch64-linux-gnu; lg_page=16 ;; \
      *) echo "unsupported TARGETARCH '$TARGETARCH': build linux/amd64 or linux/arm64 with BuildKit (docker buildx build)" >&2; exit 1 ;; \
    esac; \
    if [ "$TARGETARCH" != "$BUILDARCH" ]; then \
      apt-get update; \
      apt-get install -y --no-install-recommends "$gcc" "libc6-dev-$TARGETARCH-cross"; \
      rm -rf /var/lib/apt/lists/*; \
    fi; \
    rustup target add "$triple"; \
    upper=$(echo "$triple" | tr 'a-z-' 'A-Z_'); lower=$(echo "$triple" | tr '-' '_'); \
    { echo "export CARGO_BUILD_TARGET=$triple"; \
      echo "export CARGO_TARGET_${upper}_LINKER=$gnu-gcc"; \
      echo "export CC_${lower}=$gnu-gcc AR_${lower}=$gnu-ar"; \
      echo "export JEMALLOC_SYS_WITH_LG_PAGE=$lg_page"; \
      echo "export RUNFEED_TARGET_DIR=target/$triple/release"; } > /cross.env
COPY Cargo.toml Cargo.lock ./
COPY .cargo ./.cargo
COPY src ./src
COPY crates ./crates
COPY migrations ./migrations
COPY config ./config
# The commit the image is built from, for `runfeed_build_info{commit}` (optional; "unknown"
# when not given). Declared after the dependency-free steps above so it does not void their cache.
ARG RUNFEED_BUILD_COMMIT=""
# Cache the registry and the target dir between builds (BuildKit; each target platform builds
# under target/<triple>/, so both platforms share one cache); copy the binaries out of the cache
# mount so the next stages can see them.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    . /cross.env \
 && RUNFEED_BUILD_COMMIT="$RUNFEED_BUILD_COMMIT" \
    cargo build --release --locked --bin runfeed --bin runfeed-demo \
 && install -m 0755 "$RUNFEED_TARGET_DIR/runfeed" "$RUNFEED_TARGET_DIR/runfeed-demo" /usr/local/bin/

# The runtime files, prepared on the build platform (the CA bundle and the account database are
# the same on every architecture): the runtime stages below only copy them.
FROM --platform=$BUILDPLATFORM debian:bookworm-slim AS rootfs
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin runfeed

FROM debian:bookworm-slim AS base
COPY --from=rootfs /etc/passwd /etc/group /etc/
COPY --from=rootfs /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt

# The demo workload (development only): seeds a demo environment and keeps runs changing.
FROM base AS demo
COPY --from=builder /usr/local/bin/runfeed-demo /usr/local/bin/runfeed-demo
USER runfeed:runfeed
ENTRYPOINT ["runfeed-demo"]

FROM base AS runtime
COPY --from=builder /usr/local/bin/runfeed /usr/local/bin/runfeed
COPY config/default.toml /etc/runfeed/default.toml
USER runfeed:runfeed
# In containers: JSON logs, and the admin listener (/metrics, /healthz, /readyz) reachable by a
# scraper on the container network (keep port 9464 off the public network).
ENV RUNFEED_TELEMETRY__LOG_FORMAT=json \
    RUNFEED_TELEMETRY__ADMIN_LISTEN=0.0.0.0:9464
EXPOSE 3030 9464
# No curl in the image: probe /healthz with bash's /dev/tcp, on the address `serve` listens on: its
# --listen (from PID 1's command line, also under `docker run --init`), else RUNFEED_LISTEN or
# RUNFEED_SERVER__LISTEN, else the built-in default; a wildcard address is probed on loopback.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["bash", "-c", "l=${RUNFEED_LISTEN:-${RUNFEED_SERVER__LISTEN:-127.0.0.1:3030}}; \
mapfile -d '' a </proc/1/cmdline; \
for i in \"${!a[@]}\"; do case ${a[i]} in --listen) l=${a[i+1]} ;; --listen=*) l=${a[i]#*=} ;; esac; done; \
h=${l%:*}; h=${h#[}; h=${h%]}; case $h in 0.0.0.0) h=127.0.0.1 ;; ::) h=::1 ;; esac; \
exec 3<>/dev/tcp/$h/${l##*:} && printf 'GET /healthz HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n' >&3 && head -n 1 <&3 | grep -q ' 200 '"]
ENTRYPOINT ["runfeed"]
CMD ["serve", "--listen", "0.0.0.0:3030"]
