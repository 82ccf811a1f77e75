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
for _ in $(seq 1 50); do answers 4222 && answers 6379 && exit 0; sleep 0.1; done
echo "services: NATS or Redis did not come up" >&2
exit 1
