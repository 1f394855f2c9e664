#!/usr/bin/env bash
# Start, stop or query a local MLflow tracking server (API + UI) on 127.0.0.1.
#
#   infra/mlflow-server.sh start|stop|status
#
# Environment (all optional):
#   CLMA_MLFLOW_HOST                  loopback address to bind (default 127.0.0.1)
#   CLMA_MLFLOW_PORT                  port (default 5000)
#   CLMA_MLFLOW_BACKEND_STORE_URI     default sqlite:///$CLMA_INFRA_DIR/mlflow/mlflow.db;
#                                     PostgreSQL: postgresql://USER:PASSWORD@HOST:5432/DB
#                                     (needs the psycopg2 driver in the venv)
#   CLMA_MLFLOW_ARTIFACTS_DESTINATION default $CLMA_INFRA_DIR/mlflow/artifacts (served by
#                                     the server: clients need no access to the folder)
#   CLMA_MLFLOW_WORKERS               server workers (default 1: lean, ~500 MB)
#   CLMA_INFRA_DIR, CLMA_VENV, CLMA_START_TIMEOUT   as in prefect-server.sh
# Then point clients at it:  export MLFLOW_TRACKING_URI=http://127.0.0.1:5000
set -euo pipefail
. "$(dirname "$0")/lib.sh"

HOST="${CLMA_MLFLOW_HOST:-127.0.0.1}"
PORT="${CLMA_MLFLOW_PORT:-5000}"
STORE_DIR="$CLMA_INFRA_DIR/mlflow"
BACKEND="${CLMA_MLFLOW_BACKEND_STORE_URI:-sqlite:///$STORE_DIR/mlflow.db}"
ARTIFACTS="${CLMA_MLFLOW_ARTIFACTS_DESTINATION:-$STORE_DIR/artifacts}"
WORKERS="${CLMA_MLFLOW_WORKERS:-1}"
PIDFILE="$CLMA_INFRA_DIR/mlflow-server-$PORT.pid"
LOGFILE="$CLMA_INFRA_DIR/mlflow-server-$PORT.log"
HEALTH="http://$HOST:$PORT/health"
check_loopback "$HOST"; check_port "$PORT"

case "${1:-}" in
    start)
        mkdir -p "$STORE_DIR"
        case "$ARTIFACTS" in *://*) ;; *) mkdir -p "$ARTIFACTS" ;; esac
        MLFLOW="$(tool mlflow)"
        unset MLFLOW_TRACKING_URI
        # Lean server (see shared STACK notes): no job-execution workers, one web worker.
        export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
        start_server "MLflow server" "$PIDFILE" "$LOGFILE" "$HOST" "$PORT" "$HEALTH" -- \
            "$MLFLOW" server --host "$HOST" --port "$PORT" \
            --backend-store-uri "$BACKEND" --artifacts-destination "$ARTIFACTS" \
            --workers "$WORKERS"
        echo "export MLFLOW_TRACKING_URI=http://$HOST:$PORT"
        ;;
    stop) stop_server "MLflow server" "$PIDFILE" ;;
    status) status_server "MLflow server" "$PIDFILE" "$HEALTH" ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
