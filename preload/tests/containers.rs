//! Programs where containers put them (issue 23): in a network namespace of their own made by
//! `unshare -n` (no name under /run/netns, nobody attached anything there beforehand), in
//! a cgroup below the cgroup v2 root (systemd services, containers), and in a user namespace
//! of their own (systemd's `PrivateUsers=`, issue 35). redis-server and
//! redis-benchmark under the shim, both on 127.0.0.1, with the real TCP option program (its
//! default pins, as `smcr bpf install` leaves them): every request succeeds and every
//! connection is SMC-R (the shim's log, and the server's TCP sockets carried at most the
//! handshake).

#[path = "common/mod.rs"]
mod common;

use std::process::Command;

/// Runs `script` (bash) with `LIB` (the library), `PORT`, `LOG` (the shim log prefix) and
/// `SS` (where to write `ss -tin` of the server's sockets while the benchmark runs) set;
/// returns its output and the shim log's lines.
fn run(tag: &str, wrap: &[&str], script: &str) -> (String, String) {
    let dir = std::env::temp_dir().join(format!("smcr-ct-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let port = common::port(41000);
    let log = dir.join("smcr.log");
    let out = Command::new(wrap[0])
        .args(&wrap[1..])
        .args(["bash", "-c", script])
        .env("LIB", common::lib())
        .env("PORT", port.to_string())
        .env("LOG", &log)
        .env("DIR", &dir)
        .env("SMCR_STATS_DIR", dir.join("stats"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    if std::env::var_os("SMCR_KEEP_LOGS").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    assert!(out.status.success(), "{tag}: {text}\n{logged}");
    (text, logged)
}

/// The redis pair, run by the wrapper's shell: the benchmark's rates, then the most bytes any
/// server TCP socket received while it ran (`MAXRX n`).
const REDIS: &str = r#"
set -e
LD_PRELOAD=$LIB SMCR_LOG=$LOG redis-server --bind 127.0.0.1 --port $PORT --save "" \
  --appendonly no --dir $DIR >$DIR/redis.out 2>&1 &
srv=$!
up=0
for i in $(seq 100); do
  (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && { up=1; break; }
  kill -0 $srv 2>/dev/null || break
  sleep 0.1
done
if [ $up = 0 ]; then echo "redis-server did not start:"; cat $DIR/redis.out; exit 1; fi
: >$LOG
LD_PRELOAD=$LIB SMCR_LOG=$LOG redis-benchmark -h 127.0.0.1 -p $PORT -c 20 -n 20000 \
  -t set,get --csv &
bench=$!
max=0
while kill -0 $bench 2>/dev/null; do
  m=$(ss -tinH state established "( sport = :$PORT )" | grep -o 'bytes_received:[0-9]*' \
      | cut -d: -f2 | sort -n | tail -1)
  [ -n "$m" ] && [ "$m" -gt "$max" ] && max=$m
  sleep 0.05
done
wait $bench
echo "MAXRX $max"
kill $srv
"#;

fn check(tag: &str, text: &str, logged: &str) {
    let csv: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("\"SET\"") || l.starts_with("\"GET\""))
        .collect();
    assert_eq!(
        csv.len(),
        2,
        "{tag}: redis-benchmark did not report SET and GET:\n{text}"
    );
    let smcr = |what: &str| {
        logged
            .lines()
            .filter(|l| l.contains(&format!(" {what} ")) && l.contains("): SMC-R"))
            .count()
    };
    // (The readiness probe, a plain client, may be accepted after the log was emptied.)
    let other = logged
        .lines()
        .filter(|l| {
            (l.contains(" connect ") || l.contains(" accept "))
                && !l.contains("): SMC-R")
                && !l.contains("PEERNOSMC")
        })
        .count();
    assert!(
        smcr("connect") >= 20 && smcr("accept") >= 20 && other == 0,
        "{tag}: {} SMC-R connects, {} SMC-R accepts, {other} others:\n{logged}",
        smcr("connect"),
        smcr("accept")
    );
    let max: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MAXRX ")?.trim().parse().ok())
        .expect("MAXRX line");
    // 20 000 requests of ~30 bytes each over TCP would be far more.
    assert!(
        max < 1000,
        "{tag}: a server TCP socket received {max} bytes: payload over TCP"
    );
}

fn ready() -> bool {
    common::root("network namespaces and cgroups")
        && common::have("redis-server")
        && common::have("redis-benchmark")
        && common::have("unshare")
        && smcr::option::install(std::path::Path::new(smcr::option::DEFAULT_DIR)).is_ok()
}

#[test]
fn a_network_namespace_of_its_own() {
    if !ready() {
        return;
    }
    let script = format!("ip link set lo up\n{REDIS}");
    let (text, logged) = run("unshare", &["unshare", "-n"], &script);
    check("unshare -n", &text, &logged);
}

#[test]
fn a_cgroup_below_the_root() {
    if !ready() {
        return;
    }
    let Some(root) = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .find(|l| {
            l.split(" - ")
                .nth(1)
                .is_some_and(|r| r.starts_with("cgroup2 "))
        })
        .and_then(|l| l.split_whitespace().nth(4).map(str::to_owned))
    else {
        assert_ne!(
            std::env::var("SMCR_REQUIRE_TOOLS").as_deref(),
            Ok("1"),
            "no cgroup v2 hierarchy"
        );
        eprintln!("SKIP: no cgroup v2 hierarchy mounted");
        return;
    };
    let cg = std::path::Path::new(&root).join(format!("smcr-test-{}", std::process::id()));
    let _ = std::fs::create_dir(&cg);
    let script = format!(
        "echo $$ > {}/cgroup.procs\ngrep -q '^0::/smcr-test-' /proc/self/cgroup\n{REDIS}",
        cg.display()
    );
    let (text, logged) = run("cgroup", &["env"], &script);
    let _ = std::fs::remove_dir(&cg);
    check("child cgroup", &text, &logged);
}

/// A server in a user namespace of its own (systemd's `PrivateUsers=`: only its user mapped,
/// here `nobody`) sees every unmapped peer as the overflow uid 65534 — its own uid. Users do
/// not decide who shares memory (the pair proves itself, issue 37): a root client shares
/// memory with it as with anyone, and each side shows the other's process as its namespace
/// sees it (the server: the overflow uid). Requests succeed and the connections are SMC-R.
/// smc-stat, as root, shows the server (found through /proc/PID/fd when its area has no
/// file) and the link's transport.
#[test]
fn a_server_in_a_user_namespace_shares_memory_with_a_root_client() {
    if !ready() || !common::have("setpriv") {
        return;
    }
    let smc_stat = common::bin("smc-stat");
    let script = format!(
        r#"
set -e
# The stats directory is root's: the server's area has no file (a memfd).
mkdir -p $DIR/stats; chmod 755 $DIR/stats
setpriv --reuid nobody --regid nogroup --clear-groups unshare -U --map-current-user \
  env LD_PRELOAD=$LIB SMCR_LOG=$LOG.srv redis-server --bind 127.0.0.1 --port $PORT --save "" \
  --appendonly no --dir / >$DIR/redis.out 2>&1 &
srv=$!
for i in $(seq 100); do
  (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break
  sleep 0.1
done
grep -q '^ *65534 *65534 *1$' /proc/$(pgrep -n -f "redis-server 127.0.0.1:$PORT")/uid_map
# A load that lasts until smc-stat has seen the server's link group.
LD_PRELOAD=$LIB SMCR_LOG=$LOG redis-benchmark -h 127.0.0.1 -p $PORT -c 4 -n 100000000 \
  -t get -q >/dev/null 2>&1 &
bench=$!
for i in $(seq 200); do
  {smc_stat} --json --dir $DIR/stats >$DIR/stat.json
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(not any(l["command"] == "redis-server" for l in d["link_groups"]))' $DIR/stat.json && break
  sleep 0.1
done
# A link takes the same-host transport once both ends hold the other's offer (a few ms in).
sleep 1
{smc_stat} --json --dir $DIR/stats >$DIR/stat.json
echo "STAT $(tr -d '\n' <$DIR/stat.json)"
kill $bench; wait $bench || true
# Requests succeed, over SMC-R too.
LD_PRELOAD=$LIB SMCR_LOG=$LOG redis-cli -h 127.0.0.1 -p $PORT set k userns
echo "GOT $(LD_PRELOAD=$LIB SMCR_LOG=$LOG redis-cli -h 127.0.0.1 -p $PORT get k)"
kill $srv
"#,
        smc_stat = smc_stat.display()
    );
    let (text, logged) = run("userns", &["env"], &script);
    assert!(
        text.lines().any(|l| l.trim() == "GOT userns"),
        "the value did not come back:\n{text}"
    );
    assert!(logged.contains("): SMC-R"), "not SMC-R:\n{logged}");
    let stat: serde_json::Value = serde_json::from_str(
        text.lines()
            .find_map(|l| l.strip_prefix("STAT "))
            .expect("STAT line"),
    )
    .unwrap();
    let links = stat["link_groups"].as_array().expect("link_groups");
    let server: Vec<_> = links
        .iter()
        .filter(|l| l["command"] == "redis-server")
        .collect();
    assert!(!server.is_empty(), "the server's area not found: {stat}");
    for l in links {
        assert_eq!(l["transport"], "shm", "not over shared memory: {l}");
    }
    for l in &server {
        assert_eq!(
            l["peer_uid"], 65534,
            "root, unmapped, as the server sees it: {l}"
        );
    }
}

/// A client in a network namespace of its own (made by `unshare -n`, joined to the host by a
/// veth pair) and a server on the host, each under its own user (redis-server as `redis`,
/// redis-benchmark as `nobody`): two addresses, two namespaces, one host. They find each
/// other through the host-wide rendezvous (`/run/smcr/rdv`, made by `smcr bpf install`) and
/// move the data through shared memory (issue 37). With `container`, the client's namespace
/// has its own mount namespace too, whose `/run` is a fresh tmpfs holding only a bind mount
/// of the host's `/run/smcr`, as a container gets the directory.
fn host_and_namespace(tag: &str, container: bool) {
    if !ready() || !common::have("setpriv") || !common::have("nsenter") {
        return;
    }
    let smc_stat = common::bin("smc-stat");
    let smc_stat = smc_stat.display();
    let sub = 20 + std::process::id() % 200 + u32::from(container);
    let prelude = if container {
        // A container's /run: its own, with the host's /run/smcr bind-mounted.
        r#"mount --make-rprivate /
keep=$(mktemp -d); mount --bind /run/smcr $keep
mount -t tmpfs tmpfs /run; mkdir -p /run/smcr; mount --bind $keep /run/smcr
echo "RUN $(echo $(ls /run))""#
    } else {
        ""
    };
    let unshare = if container {
        "unshare -m -n"
    } else {
        "unshare -n"
    };
    let script = format!(
        r#"
set -e
chmod 1777 $DIR; mkdir -p $DIR/stats; chmod 1777 $DIR/stats
HA=10.91.{sub}.1; CA=10.91.{sub}.2; VH=smh{sub}
trap 'ip link del $VH 2>/dev/null || true' EXIT
{unshare} bash -c '
set -e
{prelude}
echo $$ > '$DIR'/ns.pid
while ! ip link show vc >/dev/null 2>&1; do sleep 0.02; done
ip link set lo up; ip addr add '$CA'/24 dev vc; ip link set vc up
while [ ! -e '$DIR'/go ]; do sleep 0.02; done
setpriv --reuid nobody --regid nogroup --clear-groups env LD_PRELOAD=$LIB SMCR_LOG=$LOG.cli \
  redis-benchmark -h '$HA' -p $PORT -c 20 -n 60000 -t set,get --csv
' >$DIR/bench.out 2>&1 &
client=$!
for i in $(seq 200); do [ -s $DIR/ns.pid ] && break; sleep 0.02; done
ip link add $VH type veth peer name vc netns $(cat $DIR/ns.pid)
ip addr add $HA/24 dev $VH; ip link set $VH up
setpriv --reuid redis --regid redis --clear-groups env LD_PRELOAD=$LIB SMCR_LOG=$LOG \
  redis-server --bind $HA --port $PORT --protected-mode no --save "" --appendonly no \
  --dir $DIR >$DIR/redis.out 2>&1 &
srv=$!
for i in $(seq 100); do
  (exec 3<>/dev/tcp/$HA/$PORT) 2>/dev/null && break
  sleep 0.1
done
: >$LOG
touch $DIR/go
max=0; shm=""
while kill -0 $client 2>/dev/null; do
  m=$(ss -tinH state established "( sport = :$PORT )" | grep -o 'bytes_received:[0-9]*' \
      | cut -d: -f2 | sort -n | tail -1)
  [ -n "$m" ] && [ "$m" -gt "$max" ] && max=$m
  {smc_stat} --json --dir $DIR/stats >$DIR/stat.json 2>/dev/null || true
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); l=[x for x in d["link_groups"] if x["command"]=="redis-server"]; print(" ".join("%s:%s" % (x["transport"], x["peer_uid"]) for x in l if x["same_host"] != "pending"))' $DIR/stat.json >$DIR/links 2>/dev/null || true
  # (The group goes with the client's exit: a later sample without it keeps this one.)
  grep -q . $DIR/links 2>/dev/null && shm=$(cat $DIR/links)
  sleep 0.05
done
wait $client || {{ cat $DIR/bench.out; exit 1; }}
cat $DIR/bench.out
cat $LOG.cli >>$LOG
echo "MAXRX $max"
echo "LINKS $shm"
kill $srv
"#
    );
    let (text, logged) = run(tag, &["env"], &script);
    check(tag, &text, &logged);
    if container {
        // (mount(8) leaves its own /run/mount.)
        let run = text
            .lines()
            .find_map(|l| l.strip_prefix("RUN "))
            .expect("RUN line");
        assert!(
            run.split_whitespace().any(|w| w == "smcr")
                && run.split_whitespace().all(|w| w == "smcr" || w == "mount"),
            "the container's /run: {run}\n{text}"
        );
    }
    let links = text
        .lines()
        .find_map(|l| l.strip_prefix("LINKS "))
        .expect("LINKS line");
    assert!(!links.trim().is_empty(), "no server link seen:\n{text}");
    for l in links.split_whitespace() {
        assert_eq!(
            l, "shm:65534",
            "a server link not over shared memory with nobody:\n{text}"
        );
    }
}

#[test]
fn a_namespace_of_its_own_and_the_host_share_memory() {
    host_and_namespace("ns-host", false);
}

#[test]
fn a_container_with_run_smcr_mounted_and_the_host_share_memory() {
    host_and_namespace("container-host", true);
}
