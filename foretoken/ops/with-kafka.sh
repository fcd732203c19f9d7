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
    export FORETOKEN_STATE_DIR="$fresh"
  fi
fi
state=$("$ft" kafka up) || { echo "error: no Kafka broker (see the message above)" >&2; exit 1; }
unset FORETOKEN_STATE_DIR
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
