# syntax=docker/dockerfile:1
# runfeed: multi-stage build. The builder compiles the release binaries with the locked
# dependency set; the runtime image (the last stage, the default target) is Debian slim with the
# server binary, CA certificates and a non-root user. The `demo` stage carries only the
# development workload `runfeed-demo` (crates/runfeed-dev), for docker-compose.yml's demo.
#   docker build -t runfeed .
#   docker build --target demo -t runfeed-demo .
#   docker run --rm -p 3030:3030 -e DATABASE_URL=… -e REDIS_URL=… runfeed
# tests/deploy.rs checks this file statically (cargo test --test deploy).

FROM rust:1.95-bookworm AS builder
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY crates ./crates
COPY migrations ./migrations
COPY config ./config
# Cache the registry and the target dir between builds (BuildKit); copy the binary out of the
# cache mount so the next stage can see it.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin runfeed --bin runfeed-demo \
 && install -m 0755 target/release/runfeed target/release/runfeed-demo /usr/local/bin/

FROM debian:bookworm-slim AS base
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin runfeed

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
# No curl in the image: probe /healthz with bash's /dev/tcp.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/3030 && printf 'GET /healthz HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n' >&3 && head -n 1 <&3 | grep -q ' 200 '"]
ENTRYPOINT ["runfeed"]
CMD ["serve", "--listen", "0.0.0.0:3030"]
