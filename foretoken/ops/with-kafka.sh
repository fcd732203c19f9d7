#!/usr/bin/env bash
# Run a command with a Kafka broker: the one in $KAFKA_BOOTSTRAP_SERVERS, one already running,
# or a local one started here, which is stopped again afterwards (also on failure or Ctrl-C).
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
ft="$here/.venv/bin/foretoken"
state=$("$ft" kafka up) || { echo "error: no Kafka broker (see the message above)" >&2; exit 1; }
if [ "$state" = "started" ]; then
  trap '"$ft" kafka down' EXIT
fi
"$@"
