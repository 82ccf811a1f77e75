#!/usr/bin/env bash
# Start NATS (JetStream) on 127.0.0.1:4222 and Redis on 127.0.0.1:6379 if they are not
# already answering. Tests that restart or kill a server start their own on a free port.
set -euo pipefail
answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
if ! answers 4222; then
  if [ -x /usr/sbin/nats-server ]; then
    mkdir -p /var/lib/nats-server
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
      -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server
  else
    echo "services: nats-server not installed; tests start their own where they can" >&2
  fi
fi
if ! answers 6379; then
  if command -v redis-server >/dev/null; then
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
  else
    echo "services: redis-server not installed; tests start their own where they can" >&2
  fi
fi
# Headless browser for tests/integration/test_api_dashboard.py: Debian's chromium.
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "services: installing chromium (apt) for the dashboard browser test" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
      || echo "services: chromium install failed; the dashboard browser test will fail" >&2
  else
    echo "services: /usr/bin/chromium missing and not root; run as root: apt-get install -y chromium" >&2
  fi
fi
# docker-compose (v1, Debian) validates compose/ in tests/unit/test_compose.py; no engine needed.
if ! command -v docker-compose >/dev/null && ! docker compose version >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null; } \
      || echo "services: docker-compose install failed; the compose validation test will fail" >&2
  else
    echo "services: docker-compose missing and not root; run as root: apt-get install -y docker-compose" >&2
  fi
fi
# prometheus + promtool (Debian) for tests/integration/test_compose_scrape.py: the compose
# Prometheus config checked by promtool, and a real Prometheus scraping the stack on loopback.
# The package's own service must not start (it would listen on 0.0.0.0:9090): policy-rc.d.
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    made_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && made_policy=1
    fi
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } \
      || echo "services: prometheus install failed; the compose scrape test will fail" >&2
    if [ "$made_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  else
    echo "services: prometheus missing and not root; run as root: apt-get install -y --no-install-recommends prometheus" >&2
  fi
fi
# wrk (Debian): the HTTP load generator bench/api.py prefers (a C client keeps the client's
# own cost out of the API's figures); the bench falls back to httpx without it.
if ! command -v wrk >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; } \
      || echo "services: wrk install failed; bench/api.py will use httpx clients" >&2
  fi
fi
for _ in $(seq 1 50); do answers 4222 && answers 6379 && exit 0; sleep 0.1; done
echo "services: NATS or Redis did not come up" >&2
exit 1
