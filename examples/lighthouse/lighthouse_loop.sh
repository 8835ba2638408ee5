#!/usr/bin/env bash
# Keep a replica job's lighthouse up: run `lightning-ft lighthouse` and start it again, at the same address, whenever
# it ends (killed, out of memory, crashed). Replica groups wait for it (ReplicaGroups(lighthouse_wait=...), 5 minutes
# by default) and go on at the next quorum once it is back: an outage costs them its duration
# (docs/replica-groups.md, "When the lighthouse dies").
#
# Usage: lighthouse_loop.sh ENV_FILE [lightning-ft lighthouse options...]
#   Writes the lighthouse's line, TORCHFT_LIGHTHOUSE=http://HOST:PORT, to ENV_FILE once it first listens
#   (`export $(cat ENV_FILE)` sets it for the groups). A --bind with port 0 gets a port from the OS at the first start;
#   every restart binds that same port. SIGTERM or SIGINT stops the lighthouse and the loop, exit code 0.
# Environment: LIGHTHOUSE_COMMAND (default "lightning-ft lighthouse"), LIGHTHOUSE_RESTART_DELAY_S (default 1).
set -u
if [ $# -lt 1 ]; then
    echo "usage: $0 ENV_FILE [lightning-ft lighthouse options...]" >&2
    exit 2
fi
env_file=$1
shift
read -r -a command <<< "${LIGHTHOUSE_COMMAND:-lightning-ft lighthouse}"
args=("$@")
delay=${LIGHTHOUSE_RESTART_DELAY_S:-1}
pid=""

stop() {
    if [ -n "$pid" ]; then
        kill -TERM "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    fi
    exit 0
}
trap stop TERM INT

starts=0
while true; do
    "${command[@]}" "${args[@]}" > "$env_file.starting" &
    pid=$!
    starts=$((starts + 1))
    until [ -s "$env_file.starting" ] || ! kill -0 "$pid" 2>/dev/null; do
        sleep 0.2
    done
    if [ -s "$env_file.starting" ]; then
        mv -f "$env_file.starting" "$env_file"
        port=$(sed -n 's/^TORCHFT_LIGHTHOUSE=.*:\([0-9][0-9]*\)\/*$/\1/p' "$env_file")
        for i in "${!args[@]}"; do  # --bind HOST:0: keep the port the OS chose for every restart
            if [ "${args[$i]}" = "--bind" ] && [[ "${args[i + 1]:-}" == *:0 ]] && [ -n "$port" ]; then
                args[i + 1]="${args[i + 1]%:0}:$port"
            fi
        done
        echo "lighthouse_loop: lighthouse $starts listening ($(cat "$env_file")), pid $pid" >&2
    fi
    wait "$pid"
    code=$?
    pid=""
    echo "lighthouse_loop: the lighthouse exited with code $code; starting it again in ${delay} s" >&2
    sleep "$delay"
done
