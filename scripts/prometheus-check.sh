#!/usr/bin/env bash
# A throwaway Prometheus (Debian's `prometheus` package) on loopback that scrapes one runfeed
# admin listener every second, for the dashboard-query test (tests/it/telemetry.rs,
# `dashboard_panels_return_series`).
#
#   bash scripts/prometheus-check.sh install
#       Installs Debian's prometheus if `prometheus` is not on PATH (without starting its
#       system service).
#   bash scripts/prometheus-check.sh start TARGET [LIFETIME_S]
#       TARGET: host:port of runfeed's admin listener (telemetry.admin_listen).
#       Starts Prometheus on a free 127.0.0.1 port with grafana/prometheus.yml (the compose
#       scrape config) retargeted at TARGET and a 1 s scrape interval, storage in a temp dir.
#       Prints PROMETHEUS_URL=http://127.0.0.1:PORT and PROMETHEUS_PID=PID once it is ready,
#       then returns. Prometheus stops by itself after LIFETIME_S (default 180) or on
#       `kill PID`; its temp dir is removed when it stops.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)

log() { printf '[prometheus-check] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo -n "$@"
  else "$@"
  fi
}

install_prometheus() {
  command -v prometheus >/dev/null 2>&1 && return 0
  command -v apt-get >/dev/null 2>&1 || die "prometheus not found and no apt-get; install Prometheus yourself"
  # The package's maintainer scripts would start a system-wide Prometheus on :9090; keep them
  # from starting services during the install (policy-rc.d, the Debian container convention).
  local policy=/usr/sbin/policy-rc.d added=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | as_root tee "$policy" >/dev/null
    as_root chmod +x "$policy"
    added=1
  fi
  local rc=0
  log "apt-get install prometheus"
  if ! as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1; then
    as_root apt-get update -qq && \
      as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null || rc=$?
  fi
  [ "$added" -eq 1 ] && as_root rm -f "$policy"
  [ "$rc" -eq 0 ] || die "apt-get install prometheus failed"
  command -v prometheus >/dev/null 2>&1 || die "prometheus still not on PATH after the install"
}

tcp_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

free_port() {
  local port i
  for i in $(seq 1 50); do
    # Below the kernel's ephemeral range (32768-60999 by default): a port there can be taken
    # by another test's outgoing connection between this check and Prometheus' bind.
    port=$(( 20000 + (RANDOM * 32768 + RANDOM) % 12700 ))
    if ! tcp_open 127.0.0.1 "$port"; then echo "$port"; return 0; fi
  done
  die "no free port found"
}

start_prometheus() {
  local target=$1 lifetime=${2:-180}
  [[ "$target" =~ ^[A-Za-z0-9._-]+:[0-9]+$ ]] || die "TARGET must be host:port, got '$target'"
  install_prometheus
  local dir port pid
  dir=$(mktemp -d "${TMPDIR:-/tmp}/runfeed-prometheus.XXXXXX")
  port=$(free_port)
  # The compose scrape config, retargeted: same job and metrics path, 1 s interval.
  sed -e "s#runfeed:9464#${target}#" \
      -e "s#^\( *\)scrape_interval:.*#\1scrape_interval: 1s#" \
      -e "s#^\( *\)evaluation_interval:.*#\1evaluation_interval: 1s#" \
      "$ROOT/grafana/prometheus.yml" > "$dir/prometheus.yml"
  grep -q "$target" "$dir/prometheus.yml" || die "grafana/prometheus.yml has no runfeed:9464 target to rewrite"
  (
    timeout --kill-after=5 "$lifetime" prometheus \
      --config.file="$dir/prometheus.yml" \
      --storage.tsdb.path="$dir/data" \
      --web.listen-address="127.0.0.1:$port" \
      --log.level=warn >"$dir/prometheus.log" 2>&1 &
    echo $! > "$dir/pid"
    wait $! || true
    rm -rf "$dir"
  ) </dev/null >/dev/null 2>&1 &
  local i
  for i in $(seq 1 100); do
    [ -s "$dir/pid" ] && break
    sleep 0.05
  done
  pid=$(cat "$dir/pid")
  for i in $(seq 1 300); do
    if tcp_open 127.0.0.1 "$port" && (exec 3<>"/dev/tcp/127.0.0.1/$port"; printf 'GET /-/ready HTTP/1.0\r\n\r\n' >&3; head -n1 <&3) 2>/dev/null | grep -q ' 200'; then
      echo "PROMETHEUS_URL=http://127.0.0.1:$port"
      echo "PROMETHEUS_PID=$pid"
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      cat "$dir/prometheus.log" >&2 2>/dev/null || true
      die "prometheus exited before it was ready"
    fi
    sleep 0.1
  done
  kill "$pid" 2>/dev/null || true
  die "prometheus not ready on 127.0.0.1:$port after 30 s"
}

case "${1:-}" in
  install) install_prometheus ;;
  start) shift; [ $# -ge 1 ] || die "usage: $0 start TARGET [LIFETIME_S]"; start_prometheus "$@" ;;
  *) die "usage: $0 install | start TARGET [LIFETIME_S]" ;;
esac
