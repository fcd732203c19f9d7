#!/usr/bin/env bash
# Run a command with a Kafka broker: the one in $KAFKA_BOOTSTRAP_SERVERS, one already running,
# or a local one started here, which is stopped again afterwards (also on failure or Ctrl-C).
#   with-kafka.sh [--fresh] CMD...
# --fresh: a broker started here keeps its data in a new temporary directory, removed at the
# end. `make test` uses it: every suite run creates ~600 partitions (each module has topics
# of its own), and a broker whose data accumulated over many runs ran out of heap mid-suite.
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
ft="$here/.venv/bin/foretoken"
fresh=""
if [ "${1:-}" = "--fresh" ]; then
  shift
  if ! "$ft" kafka status >/dev/null 2>&1; then
    fresh=$(mktemp -d "${TMPDIR:-/tmp}/foretoken-kafka.XXXXXX")
  fi
fi
if [ -n "$fresh" ]; then  # only the broker's own commands see the temporary state dir
  state=$(FORETOKEN_STATE_DIR="$fresh" "$ft" kafka up)
else
  state=$("$ft" kafka up)
fi || { echo "error: no Kafka broker (see the message above)" >&2; exit 1; }
if [ "$state" = "started" ]; then
  if [ -n "$fresh" ]; then
    trap 'FORETOKEN_STATE_DIR="$fresh" "$ft" kafka down; rm -rf "$fresh"' EXIT
  else
    trap '"$ft" kafka down' EXIT
  fi
elif [ -n "$fresh" ]; then
  rm -rf "$fresh"
fi
"$@"
