#!/usr/bin/env bash
# A local Flower deployment on 127.0.0.1: one SuperLink and N SuperNodes, for trying a
# federation on real client processes (docs/operating.md, "Real clients").
#
#   infra/flower-local.sh start N     # SuperLink + N SuperNodes (partition-id 0..N-1)
#   infra/flower-local.sh stop        # stop them all (whole process groups, nothing left)
#   infra/flower-local.sh status
#   infra/flower-local.sh stop-node I # stop SuperNode I only (a client leaves)
#   infra/flower-local.sh certs [DIR] # self-signed CA + loopback server certificate
#
# Each SuperNode i runs the CLMA ClientApp of the runs it receives with
#   --node-config "partition-id=i num-partitions=N state-dir='<run>/nodes/i/state'
#                  data-source='<CLMA_FLOWER_DATA_SOURCE>' <CLMA_FLOWER_NODE_CONFIG>"
# and its own --port (its Runtime API). The data source is the device's data
# (clma/flower/device_data.py: "package.module:function", called on the node with its node
# config); the default is the built-in demo, the simulated digits client of partition id i.
# The federation's model comes from the run (the config's [model] factory): the SuperLink
# (which runs the ServerApp) and the SuperNodes import the user's package from the venv or
# from PYTHONPATH, which this script passes on. Insecure (plain HTTP) unless CLMA_FLOWER_TLS names
# a folder made by `certs` (ca.crt, server.crt, server.key): then the SuperLink serves TLS
# and the SuperNodes verify it with ca.crt; point the config's root_certificates there.
#
# With TLS, SuperNode authentication is on by default (CLMA_FLOWER_AUTH): each SuperNode i
# gets its own EC key pair (P-384, OpenSSH format, as flwr 1.42 expects) in <run>/keys
# (folder 0700, private key 0600, made once and reused), the SuperLink starts with
# --enable-supernode-auth, the public keys are registered with `flwr supernode register`
# before the SuperNodes start, and SuperNode i starts with --auth-supernode-private-key.
# The SuperLink refuses a SuperNode whose key is not registered (it exits: "Failed to
# activate SuperNode"). Flower refuses SuperNode authentication without TLS.
#
# Environment (all optional):
#   CLMA_FLOWER_DIR        run folder: pid files, logs, keys, node folders
#                          (default $CLMA_INFRA_DIR/flower-local)
#   CLMA_FLOWER_DATABASE   SuperLink state file (SQLite); unset = Flower's in-memory state,
#                          the default: flwr 1.42's SQLite state waits at most 5 s for its
#                          lock, and under load (ten SuperNodes on 2 cores) requests then
#                          fail with "database is locked" (HTTP 500), which ends the run.
#                          A file keeps the SuperLink's runs and nodes over a restart of it.
#   CLMA_FLOWER_HOST       loopback address (default 127.0.0.1)
#   CLMA_FLOWER_PORT       SuperLink port, all its APIs (default 9093)
#   CLMA_FLOWER_NODE_PORT  first SuperNode Runtime API port; node i uses +i (default 9110)
#   CLMA_FLOWER_TLS        folder of certs (see above); unset = insecure
#   CLMA_FLOWER_AUTH       SuperNode authentication, true or false (default: true with TLS;
#                          true without TLS is refused)
#   CLMA_FLOWER_DATA_SOURCE  every node's data source, "package.module:function"
#                          (default clma.sim.demo:simulated_shard, the built-in demo)
#   CLMA_FLOWER_NODE_CONFIG  more node config entries for every node, e.g. "site-dir='/data'"
#   CLMA_VENV              venv holding flwr and clma (default <project>/.venv)
#   CLMA_START_TIMEOUT     seconds to wait for each process (default 120)
# Then: clma run --config clma/configs/flower_local.toml   ([federation.flower] superlink =
# "127.0.0.1:9093", insecure = true; with TLS: insecure = false, root_certificates = ca.crt)
set -euo pipefail
. "$(dirname "$0")/lib.sh"

RUN="${CLMA_FLOWER_DIR:-$CLMA_INFRA_DIR/flower-local}"
HOST="${CLMA_FLOWER_HOST:-127.0.0.1}"
PORT="${CLMA_FLOWER_PORT:-9093}"
NODE_PORT="${CLMA_FLOWER_NODE_PORT:-9110}"
TLS="${CLMA_FLOWER_TLS:-}"
DATABASE="${CLMA_FLOWER_DATABASE:-}"
DATA_SOURCE="${CLMA_FLOWER_DATA_SOURCE:-clma.sim.demo:simulated_shard}"
NODE_EXTRA="${CLMA_FLOWER_NODE_CONFIG:-}"
case "$DATA_SOURCE" in
    *[!A-Za-z0-9_.:]*|*:*:*|:*|*:|"") die "CLMA_FLOWER_DATA_SOURCE='$DATA_SOURCE': must be package.module:function" ;;
    *:*) ;;
    *) die "CLMA_FLOWER_DATA_SOURCE='$DATA_SOURCE': must be package.module:function" ;;
esac
check_loopback "$HOST"; check_port "$PORT"; check_port "$NODE_PORT"
case "${CLMA_FLOWER_AUTH:-}" in
    "") if [ -n "$TLS" ]; then AUTH=1; else AUTH=0; fi ;;
    1|true|yes) AUTH=1 ;;
    0|false|no) AUTH=0 ;;
    *) die "CLMA_FLOWER_AUTH='$CLMA_FLOWER_AUTH': use true or false" ;;
esac
KEYS="$RUN/keys"
CONNECTION=clma-local  # the Flower CLI connection the script registers keys through

export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
# the SuperLink starts flower-superexec / flwr-serverapp, the SuperNodes flwr-clientapp:
# they must come from the same venv
export PATH="$CLMA_VENV/bin:$PATH"

# all processes started from PID (itself included), children first found by walking ppid
tree() {
    local all="$1" frontier="$1" next
    while [ -n "$frontier" ]; do
        next=""
        for p in $frontier; do
            for c in $(ps -eo pid=,ppid= | awk -v p="$p" '$2 == p {print $1}'); do
                all="$all $c"; next="$next $c"
            done
        done
        frontier="$next"
    done
    echo "$all"
}

stop_pidfile() {  # NAME PIDFILE: TERM the process groups of the whole tree, then KILL
    local name=$1 pidfile=$2 pid pids groups waited=0
    if ! pid_alive "$pidfile"; then rm -f "$pidfile"; return 0; fi
    pid=$(cat "$pidfile")
    pids=$(tree "$pid")
    local mine; mine=$(ps -o pgid= -p $$ | tr -d ' ')
    groups=$(for p in $pids; do ps -o pgid= -p "$p" 2>/dev/null || true; done | tr -d ' ' \
             | sort -u | grep -vx "$mine" || true)
    for g in $groups; do kill -TERM -- "-$g" 2>/dev/null || true; done
    while [ "$waited" -lt 30 ]; do
        local alive=""
        for p in $pids; do kill -0 "$p" 2>/dev/null && alive="$alive $p"; done
        [ -z "$alive" ] && break
        sleep 1; waited=$((waited + 1))
    done
    for g in $groups; do kill -KILL -- "-$g" 2>/dev/null || true; done
    for p in $pids; do kill -KILL "$p" 2>/dev/null || true; done
    rm -f "$pidfile"
    echo "$name stopped (pid $pid)"
}

wait_for() {  # NAME PIDFILE LOGFILE PATTERN: until PATTERN is in LOGFILE
    local name=$1 pidfile=$2 logfile=$3 pattern=$4 waited=0
    until grep -q -- "$pattern" "$logfile" 2>/dev/null; do
        if ! pid_alive "$pidfile"; then
            echo "$name exited during start-up; last lines of $logfile:" >&2
            tail -n 20 "$logfile" >&2
            return 1
        fi
        if [ "$waited" -ge "$CLMA_START_TIMEOUT" ]; then
            echo "$name not up after ${CLMA_START_TIMEOUT}s ($logfile)" >&2
            return 1
        fi
        sleep 1; waited=$((waited + 1))
    done
}

cmd_certs() {  # DIR: a self-signed CA and a server certificate for 127.0.0.1 / localhost
    local dir="${1:-$RUN/tls}"
    command -v openssl >/dev/null || die "openssl not found"
    mkdir -p "$dir"; chmod 700 "$dir"
    if [ -f "$dir/ca.crt" ] && [ -f "$dir/server.crt" ] && [ -f "$dir/server.key" ]; then
        echo "certificates already in $dir"; return 0
    fi
    openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=clma-local-ca" \
        -keyout "$dir/ca.key" -out "$dir/ca.crt" >/dev/null 2>&1
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" \
        -keyout "$dir/server.key" -out "$dir/server.csr" >/dev/null 2>&1
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' >"$dir/server.ext"
    openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
        -CAcreateserial -days 365 -extfile "$dir/server.ext" -out "$dir/server.crt" >/dev/null 2>&1
    chmod 600 "$dir"/*.key
    echo "certificates in $dir: ca.crt (give it to clients: root_certificates), server.crt, server.key"
}

# SuperNode keys live under the run folder, never in the repository: refuse a run folder
# inside the checkout that git does not ignore (the default, state/, is ignored).
check_keys_dir() {
    local abs root
    abs="$(realpath -m "$RUN")"; root="$(realpath -m "$CLMA_ROOT")"
    case "$abs/" in
        "$root"/*)
            if ! git -C "$CLMA_ROOT" check-ignore -q "$abs/keys" 2>/dev/null; then
                die "CLMA_FLOWER_DIR '$RUN' is inside the checkout and not git-ignored; SuperNode private keys stay outside the repository"
            fi ;;
    esac
}

# node_key I: the key pair of SuperNode I, made once (P-384, OpenSSH format: what
# `flwr supernode register` and `flower-supernode --auth-supernode-private-key` read)
node_key() {
    local i=$1 key="$KEYS/supernode-$1" mode
    (umask 077; mkdir -p "$KEYS"); chmod 700 "$KEYS"
    if [ ! -f "$key" ]; then
        (umask 077; "$(tool python)" - "$key" <<'PY'
import os, sys
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

path = sys.argv[1]
key = ec.generate_private_key(ec.SECP384R1())
pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                        serialization.NoEncryption())
pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                    serialization.PublicFormat.OpenSSH)
for name, data, mode in ((path + ".pub", pub + b"\n", 0o644), (path, pem, 0o600)):
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
PY
        ) || die "could not make the key pair of SuperNode $i in $KEYS"
    fi
    [ -f "$key.pub" ] || die "$key.pub is missing (delete $key to make a new pair)"
    mode=$(stat -c %a "$key")
    case "$mode" in
        *00) ;;
        *) die "$key: mode $mode lets group or others read the private key; run: chmod 600 '$key'" ;;
    esac
}

# register_key I: register SuperNode I's public key on the SuperLink (Control API, through
# the script's own CLI connection); a key registered before (a restart) is fine
register_key() {
    local i=$1 out
    out=$(FLWR_HOME="$RUN/cli-home" "$(tool flwr)" supernode register "$KEYS/supernode-$i.pub" \
          "$CONNECTION" --format json 2>&1) || true
    echo "SuperNode $i: $out" >>"$RUN/register.log"
    if printf '%s' "$out" | grep -q '"success": true'; then return 0; fi
    if printf '%s' "$out" | grep -q 'Public key already in use'; then return 0; fi
    echo "registering the key of SuperNode $i failed (log: $RUN/register.log)" >&2
    return 1
}

cmd_start() {
    local n="${1:-}"
    case "$n" in ''|*[!0-9]*) die "usage: $0 start N (N SuperNodes, N >= 1)" ;; esac
    [ "$n" -ge 1 ] || die "start: N must be at least 1"
    if [ "$AUTH" = 1 ]; then  # before anything is made
        [ -n "$TLS" ] || die "CLMA_FLOWER_AUTH=true needs TLS (Flower refuses --enable-supernode-auth with --insecure): set CLMA_FLOWER_TLS (make certificates: $0 certs DIR)"
        check_keys_dir
    fi
    mkdir -p "$RUN"
    if pid_alive "$RUN/superlink.pid"; then
        die "already running (SuperLink pid $(cat "$RUN/superlink.pid")); stop it first"
    fi
    port_busy "$HOST" "$PORT" && die "port $PORT on $HOST is already in use; set CLMA_FLOWER_PORT"
    local i
    for ((i = 0; i < n; i++)); do
        port_busy "$HOST" $((NODE_PORT + i)) && die "port $((NODE_PORT + i)) is in use; set CLMA_FLOWER_NODE_PORT"
    done
    local superlink node tls_link=(--insecure) tls_node=(--insecure)
    superlink="$(tool flower-superlink)"; node="$(tool flower-supernode)"
    if [ -n "$TLS" ]; then
        for f in ca.crt server.crt server.key; do
            [ -f "$TLS/$f" ] || die "CLMA_FLOWER_TLS=$TLS has no $f (make them: $0 certs $TLS)"
        done
        tls_link=(--ssl-ca-certfile "$TLS/ca.crt" --ssl-certfile "$TLS/server.crt" --ssl-keyfile "$TLS/server.key")
        tls_node=(--root-certificates "$TLS/ca.crt")
    fi
    if [ "$AUTH" = 1 ]; then
        for ((i = 0; i < n; i++)); do node_key "$i"; done
        tls_link+=(--enable-supernode-auth)
        local ca; ca="$(cd "$TLS" && pwd)/ca.crt"
        mkdir -p "$RUN/cli-home"
        printf '[superlink]\ndefault = "%s"\n\n[superlink.%s]\naddress = "%s:%s"\ninsecure = false\nroot-certificates = "%s"\n' \
            "$CONNECTION" "$CONNECTION" "$HOST" "$PORT" "$ca" >"$RUN/cli-home/config.toml"
        : >"$RUN/register.log"
    fi
    mkdir -p "$RUN/superlink-home"
    local state=()  # no --database: Flower's in-memory state (see CLMA_FLOWER_DATABASE)
    [ -n "$DATABASE" ] && state=(--database "$DATABASE")
    # a new session (setsid) per process: stop signals its whole process group
    FLWR_HOME="$RUN/superlink-home" setsid "$superlink" "${tls_link[@]}" "${state[@]}" \
        --host "$HOST" --port "$PORT" \
        --disable-runtime-dependency-installation >"$RUN/superlink.log" 2>&1 </dev/null &
    echo $! >"$RUN/superlink.pid"
    wait_for "SuperLink" "$RUN/superlink.pid" "$RUN/superlink.log" "Uvicorn running" || { cmd_stop >/dev/null; exit 1; }
    echo "SuperLink running (pid $(cat "$RUN/superlink.pid")) at $HOST:$PORT  [log: $RUN/superlink.log]"
    if [ "$AUTH" = 1 ]; then
        for ((i = 0; i < n; i++)); do register_key "$i" || { cmd_stop >/dev/null; exit 1; }; done
        echo "SuperNode authentication on: $n public keys registered (key pairs in $KEYS, private keys 0600)"
    fi
    for ((i = 0; i < n; i++)); do
        local d="$RUN/nodes/$i" auth_node=()
        [ "$AUTH" = 1 ] && auth_node=(--auth-supernode-private-key "$KEYS/supernode-$i")
        mkdir -p "$d/home" "$d/state"
        FLWR_HOME="$d/home" setsid "$node" "${tls_node[@]}" "${auth_node[@]}" --superlink "$HOST:$PORT" \
            --host "$HOST" --port $((NODE_PORT + i)) \
            --node-config "partition-id=$i num-partitions=$n state-dir='$d/state' data-source='$DATA_SOURCE'${NODE_EXTRA:+ $NODE_EXTRA}" \
            >"$d/supernode.log" 2>&1 </dev/null &
        echo $! >"$RUN/supernode-$i.pid"
    done
    for ((i = 0; i < n; i++)); do
        wait_for "SuperNode $i" "$RUN/supernode-$i.pid" "$RUN/nodes/$i/supernode.log" "SuperNode ID" \
            || { cmd_stop >/dev/null; exit 1; }
    done
    echo "$n SuperNodes connected (partition-id 0..$((n - 1)), data-source $DATA_SOURCE; logs: $RUN/nodes/<i>/supernode.log)"
    if [ -n "$TLS" ]; then
        echo "config: [federation.flower] superlink = \"$HOST:$PORT\", insecure = false, root_certificates = \"$TLS/ca.crt\""
    else
        echo "config: [federation.flower] superlink = \"$HOST:$PORT\", insecure = true"
    fi
}

cmd_stop() {
    local any=0 f
    for f in "$RUN"/supernode-*.pid; do
        [ -e "$f" ] || continue
        any=1; stop_pidfile "SuperNode $(basename "$f" .pid | sed 's/supernode-//')" "$f"
    done
    if [ -e "$RUN/superlink.pid" ]; then any=1; stop_pidfile "SuperLink" "$RUN/superlink.pid"; fi
    [ "$any" = 1 ] || echo "not running"
}

cmd_status() {
    local rc=3 f
    if pid_alive "$RUN/superlink.pid"; then
        rc=0
        if port_busy "$HOST" "$PORT"; then echo "SuperLink running (pid $(cat "$RUN/superlink.pid")) at $HOST:$PORT"
        else echo "SuperLink process $(cat "$RUN/superlink.pid") alive but $HOST:$PORT does not answer"; rc=1; fi
    else
        echo "SuperLink not running"
    fi
    for f in "$RUN"/supernode-*.pid; do
        [ -e "$f" ] || continue
        local i; i=$(basename "$f" .pid | sed 's/supernode-//')
        if pid_alive "$f"; then echo "SuperNode $i running (pid $(cat "$f"), partition-id $i)"
        else echo "SuperNode $i not running"; [ "$rc" = 0 ] && rc=1; fi
    done
    return "$rc"
}

case "${1:-}" in
    start) shift; cmd_start "$@" ;;
    stop) cmd_stop ;;
    stop-node)
        case "${2:-}" in ''|*[!0-9]*) die "usage: $0 stop-node I" ;; esac
        [ -e "$RUN/supernode-$2.pid" ] || die "no SuperNode $2 in $RUN"
        stop_pidfile "SuperNode $2" "$RUN/supernode-$2.pid" ;;
    status) cmd_status ;;
    certs) shift; cmd_certs "$@" ;;
    *) echo "usage: $0 start N | stop | stop-node I | status | certs [DIR]" >&2; exit 2 ;;
esac
