# Shared helpers of infra/prefect-server.sh and infra/mlflow-server.sh (sourced, not run).
# Servers bind to loopback only; pid files and logs live in CLMA_INFRA_DIR.

CLMA_ROOT="${CLMA_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
CLMA_INFRA_DIR="${CLMA_INFRA_DIR:-$CLMA_ROOT/state/infra}"
CLMA_VENV="${CLMA_VENV:-$CLMA_ROOT/.venv}"
CLMA_START_TIMEOUT="${CLMA_START_TIMEOUT:-120}"

die() { echo "$(basename "$0"): $*" >&2; exit 1; }

# The executable NAME from the project venv, else from PATH.
tool() {
    if [ -x "$CLMA_VENV/bin/$1" ]; then echo "$CLMA_VENV/bin/$1";
    elif command -v "$1" >/dev/null 2>&1; then command -v "$1";
    else die "'$1' not found (looked in $CLMA_VENV/bin and PATH); run 'make run' or set CLMA_VENV"; fi
}

check_loopback() {  # HOST: only loopback addresses are served
    case "$1" in
        127.*|localhost|::1) ;;
        *) die "host '$1' is not a loopback address; these scripts serve on 127.0.0.1 only" ;;
    esac
}

# load_env_file FILE: export the VAR=value lines of FILE, the place for secrets (auth strings,
# passwords). Refused when group or others may read FILE, or when FILE lies inside the
# project checkout without being git-ignored: secrets stay out of the repository.
load_env_file() {
    local f=$1 mode
    [ -f "$f" ] || die "CLMA_ENV_FILE '$f' is not a file"
    mode=$(stat -c %a "$f")
    case "$mode" in
        *00) ;;
        *) die "CLMA_ENV_FILE '$f': mode $mode lets group or others read it; run: chmod 600 '$f'" ;;
    esac
    case "$(cd "$(dirname "$f")" && pwd)/" in
        "$CLMA_ROOT"/*)
            if ! git -C "$CLMA_ROOT" check-ignore -q "$f" 2>/dev/null; then
                die "CLMA_ENV_FILE '$f' is inside the checkout and not git-ignored; keep secrets outside the repository"
            fi ;;
    esac
    set -a
    # shellcheck disable=SC1090
    . "$f"
    set +a
}

require_auth() {  # true when CLMA_REQUIRE_AUTH asks the scripts to refuse unauthenticated servers
    case "${CLMA_REQUIRE_AUTH:-false}" in
        1|true|yes) return 0 ;;
        0|false|no|"") return 1 ;;
        *) die "CLMA_REQUIRE_AUTH='$CLMA_REQUIRE_AUTH': use true or false" ;;
    esac
}

check_port() {  # PORT must be an integer in 1..65535
    case "$1" in ''|*[!0-9]*) die "port '$1' is not a number" ;; esac
    [ "$1" -ge 1 ] && [ "$1" -le 65535 ] || die "port '$1' is outside 1..65535"
}

port_busy() {  # HOST PORT -> exit 0 when something accepts connections there
    (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

pid_alive() {  # PIDFILE -> exit 0 when the recorded process is alive
    [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

http_ok() {  # URL -> exit 0 on HTTP 2xx
    curl -fsS -o /dev/null --max-time 3 "$1" 2>/dev/null
}

# start_server NAME PIDFILE LOGFILE HOST PORT HEALTH_URL -- COMMAND...
start_server() {
    local name=$1 pidfile=$2 logfile=$3 host=$4 port=$5 health=$6
    shift 7
    mkdir -p "$(dirname "$pidfile")" "$(dirname "$logfile")"
    if pid_alive "$pidfile"; then
        if http_ok "$health"; then
            echo "$name already running (pid $(cat "$pidfile")) at http://$host:$port"
            return 0
        fi
        die "$name process $(cat "$pidfile") is alive but $health does not answer; stop it first"
    fi
    rm -f "$pidfile"
    if port_busy "$host" "$port"; then
        die "port $port on $host is already in use by another process; choose another port"
    fi
    # A new session (setsid): stop signals the whole process group (server + workers).
    setsid "$@" >"$logfile" 2>&1 < /dev/null &
    echo $! >"$pidfile"
    local waited=0
    while ! http_ok "$health"; do
        if ! pid_alive "$pidfile"; then
            rm -f "$pidfile"
            echo "$name exited during start-up; last lines of $logfile:" >&2
            tail -n 20 "$logfile" >&2
            exit 1
        fi
        if [ "$waited" -ge "$CLMA_START_TIMEOUT" ]; then
            echo "$name not healthy after ${CLMA_START_TIMEOUT}s ($health); stopping it" >&2
            stop_server "$name" "$pidfile" >/dev/null
            exit 1
        fi
        sleep 1; waited=$((waited + 1))
    done
    echo "$name running (pid $(cat "$pidfile")) at http://$host:$port  [log: $logfile, healthy after ~${waited}s]"
}

stop_server() {  # NAME PIDFILE
    local name=$1 pidfile=$2
    if ! pid_alive "$pidfile"; then
        rm -f "$pidfile"
        echo "$name not running"
        return 0
    fi
    local pid; pid=$(cat "$pidfile")
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    local waited=0
    while kill -0 "$pid" 2>/dev/null; do
        if [ "$waited" -ge 30 ]; then
            kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
            break
        fi
        sleep 1; waited=$((waited + 1))
    done
    rm -f "$pidfile"
    echo "$name stopped (pid $pid)"
}

status_server() {  # NAME PIDFILE HEALTH_URL
    if pid_alive "$2"; then
        if http_ok "$3"; then echo "$1 running (pid $(cat "$2")), healthy: $3"; return 0; fi
        echo "$1 process $(cat "$2") alive but not healthy: $3"; return 1
    fi
    echo "$1 not running"; return 3
}
