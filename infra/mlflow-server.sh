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
#   CLMA_ENV_FILE                     a file of VAR=value lines read first (mode 0600, outside
#                                     the repository): the place for the passwords below
#
# Authentication (MLflow's basic-auth app, `mlflow server --app-name basic-auth`):
#   CLMA_MLFLOW_AUTH=basic            turn it on (CLMA_REQUIRE_AUTH=true refuses to start without)
#   MLFLOW_AUTH_ADMIN_USERNAME        the auth app's admin (default admin): manages accounts only
#   MLFLOW_AUTH_ADMIN_PASSWORD        its password (>= 12 characters; used when the account is
#                                     first created, MLflow ships no default)
#   CLMA_MLFLOW_OPERATOR_USERNAME / CLMA_MLFLOW_OPERATOR_PASSWORD
#                                     the account `clma run` logs with: owns (MANAGE) the
#                                     experiments and models it creates
#   CLMA_MLFLOW_READER_USERNAME / CLMA_MLFLOW_READER_PASSWORD
#                                     a read-only account (dashboards, reviews)
#   CLMA_MLFLOW_DEFAULT_PERMISSION    what every account may do where it holds no grant:
#                                     READ (default) or NO_PERMISSIONS
#   CLMA_MLFLOW_AUTH_DATABASE_URI     accounts store (default sqlite:///$CLMA_INFRA_DIR/mlflow/basic_auth.db)
#   CLMA_MLFLOW_AUTH_CACHE_SECONDS    how long a successful password check is cached (default 60)
#   MLFLOW_FLASK_SERVER_SECRET_KEY    CSRF key of the auth app (default: a random one per start)
# The accounts are created (or their passwords updated) through MLflow's auth client after
# the server is healthy; passwords travel in environment variables only, never argv or logs.
# Then point clients at it:  export MLFLOW_TRACKING_URI=http://127.0.0.1:5000
# and, with authentication, MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD.
set -euo pipefail
. "$(dirname "$0")/lib.sh"

if [ -n "${CLMA_ENV_FILE:-}" ]; then load_env_file "$CLMA_ENV_FILE"; fi
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

AUTH="${CLMA_MLFLOW_AUTH:-off}"
case "$AUTH" in
    basic|off) ;;
    *) die "CLMA_MLFLOW_AUTH='$AUTH': use basic or off" ;;
esac
if [ "$AUTH" = off ] && require_auth; then
    die "CLMA_REQUIRE_AUTH is set: start MLflow with CLMA_MLFLOW_AUTH=basic"
fi

# Writes the auth app's configuration (no secrets in it: the admin password comes from the
# environment) and exports what the server needs.
configure_auth() {
    : "${MLFLOW_AUTH_ADMIN_PASSWORD:?MLFLOW_AUTH_ADMIN_PASSWORD is required with CLMA_MLFLOW_AUTH=basic (see CLMA_ENV_FILE)}"
    [ "${#MLFLOW_AUTH_ADMIN_PASSWORD}" -ge 12 ] || die "MLFLOW_AUTH_ADMIN_PASSWORD: at least 12 characters (MLflow's rule)"
    local perm="${CLMA_MLFLOW_DEFAULT_PERMISSION:-READ}"
    case "${CLMA_MLFLOW_AUTH_CACHE_SECONDS:-60}" in ''|*[!0-9]*) die "CLMA_MLFLOW_AUTH_CACHE_SECONDS: a number of seconds" ;; esac
    case "$perm" in READ|NO_PERMISSIONS) ;; *) die "CLMA_MLFLOW_DEFAULT_PERMISSION='$perm': use READ or NO_PERMISSIONS" ;; esac
    local role user pass value
    for role in OPERATOR READER; do
        user="CLMA_MLFLOW_${role}_USERNAME"; pass="CLMA_MLFLOW_${role}_PASSWORD"
        if [ -n "${!user:-}" ]; then
            value="${!pass:-}"
            [ -n "$value" ] || die "$pass is required with $user"
            [ "${#value}" -ge 12 ] || die "$pass: at least 12 characters (MLflow's rule)"
        fi
    done
    export MLFLOW_AUTH_ADMIN_USERNAME="${MLFLOW_AUTH_ADMIN_USERNAME:-admin}"
    export MLFLOW_AUTH_ADMIN_PASSWORD
    if [ -z "${MLFLOW_FLASK_SERVER_SECRET_KEY:-}" ]; then
        MLFLOW_FLASK_SERVER_SECRET_KEY="$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')"
    fi
    export MLFLOW_FLASK_SERVER_SECRET_KEY
    local ini="$STORE_DIR/basic_auth.ini"
    (umask 077; cat >"$ini" <<EOF
# Written by infra/mlflow-server.sh at start; holds no secret (passwords come from the environment).
[mlflow]
default_permission = $perm
database_uri = ${CLMA_MLFLOW_AUTH_DATABASE_URI:-sqlite:///$STORE_DIR/basic_auth.db}
admin_username = $MLFLOW_AUTH_ADMIN_USERNAME
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
grant_default_workspace_access = false
# Successful password checks are cached this long per worker: every request otherwise
# runs a PBKDF2 hash (about a second on a busy core). Password changes through the API take
# effect at once on this worker; 0 turns the cache off.
auth_cache_ttl_seconds = ${CLMA_MLFLOW_AUTH_CACHE_SECONDS:-60}
EOF
    )
    export MLFLOW_AUTH_CONFIG_PATH="$ini"
}

# Creates the operator and read-only accounts (or updates their passwords) with MLflow's
# auth client, authenticated as the admin; credentials in the environment only.
create_accounts() {
    local py; py="$(tool python)"
    MLFLOW_TRACKING_USERNAME="$MLFLOW_AUTH_ADMIN_USERNAME" \
    MLFLOW_TRACKING_PASSWORD="$MLFLOW_AUTH_ADMIN_PASSWORD" \
    "$py" - "http://$HOST:$PORT" <<'EOF'
import os
import sys

from mlflow.exceptions import MlflowException
from mlflow.server import get_app_client

client = get_app_client("basic-auth", tracking_uri=sys.argv[1])
for role in ("OPERATOR", "READER"):
    user = os.environ.get(f"CLMA_MLFLOW_{role}_USERNAME")
    if not user:
        continue
    password = os.environ[f"CLMA_MLFLOW_{role}_PASSWORD"]
    try:
        client.get_user(user)
    except MlflowException:
        client.create_user(user, password)
        print(f"MLflow account {user!r} ({role.lower()}) created")
    else:
        client.update_user_password(user, password)
        print(f"MLflow account {user!r} ({role.lower()}) exists; password updated")
EOF
}

case "${1:-}" in
    start)
        mkdir -p "$STORE_DIR"
        case "$ARTIFACTS" in *://*) ;; *) mkdir -p "$ARTIFACTS" ;; esac
        MLFLOW="$(tool mlflow)"
        unset MLFLOW_TRACKING_URI MLFLOW_TRACKING_USERNAME MLFLOW_TRACKING_PASSWORD
        # Lean server (see shared STACK notes): no job-execution workers, one web worker.
        export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
        APP=()
        if [ "$AUTH" = basic ]; then
            umask 077  # the accounts store holds password hashes: owner-only files
            configure_auth; APP=(--app-name basic-auth)
        fi
        start_server "MLflow server" "$PIDFILE" "$LOGFILE" "$HOST" "$PORT" "$HEALTH" -- \
            "$MLFLOW" server --host "$HOST" --port "$PORT" \
            --backend-store-uri "$BACKEND" --artifacts-destination "$ARTIFACTS" \
            --workers "$WORKERS" "${APP[@]}"
        if [ "$AUTH" = basic ]; then
            create_accounts || { stop_server "MLflow server" "$PIDFILE" >/dev/null; die "creating the MLflow accounts failed; server stopped"; }
            echo "basic authentication on: clients set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (not printed)"
        fi
        echo "export MLFLOW_TRACKING_URI=http://$HOST:$PORT"
        ;;
    stop) stop_server "MLflow server" "$PIDFILE" ;;
    status) status_server "MLflow server" "$PIDFILE" "$HEALTH" ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
