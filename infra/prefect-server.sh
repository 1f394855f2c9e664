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
# Then point clients at it:  export PREFECT_API_URL=http://127.0.0.1:4200/api
set -euo pipefail
. "$(dirname "$0")/lib.sh"

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
        start_server "Prefect server" "$PIDFILE" "$LOGFILE" "$HOST" "$PORT" "$HEALTH" -- \
            "$PREFECT" server start --host "$HOST" --port "$PORT" --analytics-off
        echo "export PREFECT_API_URL=http://$HOST:$PORT/api"
        ;;
    stop) stop_server "Prefect server" "$PIDFILE" ;;
    status) status_server "Prefect server" "$PIDFILE" "$HEALTH" ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
