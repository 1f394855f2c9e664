#!/usr/bin/env bash
# Start, stop or query a local Prefect server (API + UI) on 127.0.0.1.
#
#   infra/prefect-server.sh start|stop|status
#
# Environment (all optional):
#   CLMA_PREFECT_HOST          loopback address to bind (default 127.0.0.1)
#   CLMA_PREFECT_PORT          port (default 4200)
#   CLMA_PREFECT_HOME          the server's PREFECT_HOME (default $CLMA_INFRA_DIR/prefect-home)
#   CLMA_PREFECT_DATABASE_URL  database: default SQLite in CLMA_PREFECT_HOME; PostgreSQL with
#                              postgresql+asyncpg://USER:PASSWORD@HOST:5432/DB
#   CLMA_INFRA_DIR             pid files and logs (default <project>/state/infra)
#   CLMA_VENV                  venv holding 'prefect' (default <project>/.venv)
#   CLMA_START_TIMEOUT         seconds to wait for /api/health (default 120)
#   CLMA_ENV_FILE              a file of VAR=value lines read first (mode 0600, outside the
#                              repository): the place for PREFECT_SERVER_API_AUTH_STRING
#   PREFECT_SERVER_API_AUTH_STRING  'user:password': Prefect's basic authentication; every
#                              API and UI request must present it (health checks excepted)
#   CLMA_REQUIRE_AUTH          true: refuse to start without PREFECT_SERVER_API_AUTH_STRING
# Then point clients at it:  export PREFECT_API_URL=http://127.0.0.1:4200/api
# and, with authentication, PREFECT_API_AUTH_STRING=<the same user:password> (never on a
# command line: from the env file or a secret store).
set -euo pipefail
. "$(dirname "$0")/lib.sh"

if [ -n "${CLMA_ENV_FILE:-}" ]; then load_env_file "$CLMA_ENV_FILE"; fi
HOST="${CLMA_PREFECT_HOST:-127.0.0.1}"
PORT="${CLMA_PREFECT_PORT:-4200}"
HOME_DIR="${CLMA_PREFECT_HOME:-$CLMA_INFRA_DIR/prefect-home}"
PIDFILE="$CLMA_INFRA_DIR/prefect-server-$PORT.pid"
LOGFILE="$CLMA_INFRA_DIR/prefect-server-$PORT.log"
HEALTH="http://$HOST:$PORT/api/health"
check_loopback "$HOST"; check_port "$PORT"

case "${1:-}" in
    start)
        mkdir -p "$HOME_DIR"
        PREFECT="$(tool prefect)"
        export PREFECT_HOME="$HOME_DIR"
        export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=true
        export PREFECT_UI_API_URL="http://$HOST:$PORT/api"
        unset PREFECT_API_URL
        if [ -n "${CLMA_PREFECT_DATABASE_URL:-}" ]; then
            export PREFECT_API_DATABASE_CONNECTION_URL="$CLMA_PREFECT_DATABASE_URL"
        fi
        AUTH=off
        if [ -n "${PREFECT_SERVER_API_AUTH_STRING+set}" ]; then
            case "$PREFECT_SERVER_API_AUTH_STRING" in
                ?*:?*) AUTH=basic ;;
                *) die "PREFECT_SERVER_API_AUTH_STRING must be 'user:password' (both non-empty)" ;;
            esac
            export PREFECT_SERVER_API_AUTH_STRING
        elif require_auth; then
            die "CLMA_REQUIRE_AUTH is set but PREFECT_SERVER_API_AUTH_STRING is not (see CLMA_ENV_FILE)"
        fi
        unset PREFECT_API_AUTH_STRING  # the server's own client settings come from the above
        start_server "Prefect server" "$PIDFILE" "$LOGFILE" "$HOST" "$PORT" "$HEALTH" -- \
            "$PREFECT" server start --host "$HOST" --port "$PORT" --analytics-off
        echo "export PREFECT_API_URL=http://$HOST:$PORT/api"
        if [ "$AUTH" = basic ]; then
            echo "basic authentication on: clients also need PREFECT_API_AUTH_STRING (the same user:password; not printed)"
        fi
        ;;
    stop) stop_server "Prefect server" "$PIDFILE" ;;
    status) status_server "Prefect server" "$PIDFILE" "$HEALTH" ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
