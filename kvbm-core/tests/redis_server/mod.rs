//! Real Redis servers for the shared tier's tests: `redis-server` processes on loopback at
//! free ports, in a temporary directory, stopped when dropped; and a three-master Redis Cluster
//! made by `redis-cli --cluster create`. Without `redis-server` on the PATH the tests that need
//! one are skipped with a message, unless `KVBM_TEST_REQUIRE_REDIS=1` (as in CI) makes that a
//! failure.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a server has to start answering.
const START_LIMIT: Duration = Duration::from_secs(20);

/// Whether `redis-server` can be run here; panics when it cannot and CI requires it.
pub fn available() -> bool {
    let found = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var("KVBM_TEST_REQUIRE_REDIS").as_deref() != Ok("1"),
            "redis-server is not installed, and KVBM_TEST_REQUIRE_REDIS=1 requires it"
        );
        eprintln!("redis-server is not installed: skipping (apt-get install redis-server)");
    }
    found
}

/// A port whose number and cluster-bus twin (port + 10000) are free on loopback now.
pub fn free_port() -> u16 {
    use rand::Rng;
    let mut rng = rand::thread_rng();
    loop {
        let port: u16 = rng.gen_range(20_000..45_000);
        let ok = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
        if ok(port) && ok(port + 10_000) {
            return port;
        }
    }
}

/// Sends one inline command and returns the first line of the answer ("" on failure).
pub fn ask(port: u16, password: Option<&str>, command: &str) -> String {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let mut text = String::new();
    if let Some(p) = password {
        text.push_str(&format!("AUTH {p}\r\n"));
    }
    text.push_str(command);
    text.push_str("\r\n");
    if s.write_all(text.as_bytes()).is_err() {
        return String::new();
    }
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let lines_wanted = if password.is_some() { 2 } else { 1 };
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
        if out.iter().filter(|&&b| b == b'\n').count() >= lines_wanted {
            break;
        }
    }
    let text = String::from_utf8_lossy(&out).into_owned();
    text.lines().nth(lines_wanted - 1).unwrap_or("").to_owned()
}

/// One `redis-server`.
pub struct Server {
    child: Option<Child>,
    pub port: u16,
    /// Its TLS port, when started by [`Server::start_tls`].
    pub tls_port: Option<u16>,
    args: Vec<String>,
    dir: tempfile::TempDir,
    password: Option<String>,
}

/// The test certificates (tests/data/tls: a CA, a server certificate for 127.0.0.1 and
/// localhost, a client certificate, another CA that signed neither).
pub fn tls_file(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tls")
        .join(name)
}

/// The `redis-server` arguments for TLS on `tls_port` with the test certificates; clients must
/// show a certificate from the test CA when `auth_clients`.
pub fn tls_args(tls_port: u16, auth_clients: bool) -> Vec<String> {
    let f = |n: &str| tls_file(n).display().to_string();
    vec![
        "--tls-port".into(),
        tls_port.to_string(),
        "--tls-cert-file".into(),
        f("server.pem"),
        "--tls-key-file".into(),
        f("server.key"),
        "--tls-ca-cert-file".into(),
        f("ca.pem"),
        "--tls-auth-clients".into(),
        if auth_clients { "yes" } else { "no" }.into(),
    ]
}

impl Server {
    /// A standalone server with `extra` arguments (e.g. `--maxmemory 1mb`).
    pub fn start(extra: &[&str]) -> Server {
        let dir = tempfile::tempdir().expect("temporary directory");
        let mut s = Server {
            child: None,
            port: free_port(),
            tls_port: None,
            args: extra.iter().map(|a| a.to_string()).collect(),
            dir,
            password: extra
                .iter()
                .position(|a| *a == "--requirepass")
                .map(|i| extra[i + 1].to_owned()),
        };
        // A port found free can be taken before the server binds it: then try another.
        for _ in 0..5 {
            if s.run() {
                return s;
            }
            s.port = free_port();
        }
        panic!("redis-server did not start on any of 5 free ports");
    }

    /// A standalone server that also takes TLS on a port of its own (the plain port is for
    /// the harness's own checks), with `extra` arguments.
    pub fn start_tls(auth_clients: bool, extra: &[&str]) -> Server {
        let tls_port = free_port();
        let mut args = tls_args(tls_port, auth_clients);
        args.extend(extra.iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut s = Server::start(&args);
        s.tls_port = Some(tls_port);
        s
    }

    /// `rediss://127.0.0.1:TLS_PORT`.
    pub fn tls_url(&self) -> String {
        format!(
            "rediss://127.0.0.1:{}",
            self.tls_port.expect("a TLS server")
        )
    }

    /// Starts the server; false when it exited at once (its port taken).
    fn run(&mut self) -> bool {
        let child = Command::new("redis-server")
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + START_LIMIT;
        loop {
            // A server that exited (its port taken meanwhile) must not be mistaken for whoever
            // answers on that port.
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                eprintln!("redis-server on port {} exited: {status}", self.port);
                self.child = None;
                return false;
            }
            if ask(self.port, self.password.as_deref(), "PING") == "+PONG" {
                return true;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} did not answer",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends `signal` (e.g. `STOP`, `CONT`) to the server.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("running").id();
        let ok = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{signal} {pid}");
    }

    /// Starts it again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        assert!(
            self.run(),
            "redis-server could not start again on port {}",
            self.port
        );
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A Redis Cluster of three masters, no replicas.
pub struct Cluster {
    pub nodes: Vec<Server>,
}

impl Cluster {
    pub fn start() -> Cluster {
        Self::start_with(false)
    }

    /// A cluster whose clients and bus speak TLS (`--tls-cluster yes`): the nodes announce
    /// their TLS ports; each keeps a plain port for the harness.
    pub fn start_tls() -> Cluster {
        Self::start_with(true)
    }

    fn start_with(tls: bool) -> Cluster {
        let cluster = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "5000",
        ];
        let nodes: Vec<Server> = (0..3)
            .map(|_| {
                if tls {
                    let mut extra = cluster.to_vec();
                    extra.extend(["--tls-cluster", "yes", "--tls-replication", "yes"]);
                    Server::start_tls(false, &extra)
                } else {
                    Server::start(&cluster)
                }
            })
            .collect();
        // With `--tls-cluster yes` a node's bus listens at its TLS port + 10000, which is what
        // a meet through that port computes: create the cluster through the TLS ports.
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.tls_port.unwrap_or(n.port)))
            .collect();
        let mut cli = Command::new("redis-cli");
        if tls {
            cli.arg("--tls").arg("--cacert").arg(tls_file("ca.pem"));
        }
        let out = cli
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("running redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let deadline = Instant::now() + START_LIMIT;
        for n in &nodes {
            loop {
                let info = cluster_state(n.port);
                if info == "ok" {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "cluster state on {}: {info}",
                    n.port
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Cluster { nodes }
    }

    /// Seed URLs of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Server::url).collect()
    }

    /// `rediss://` seed URLs of every node of a TLS cluster.
    pub fn tls_urls(&self) -> Vec<String> {
        self.nodes.iter().map(Server::tls_url).collect()
    }
}

/// `cluster_state` from `CLUSTER INFO` on `port`.
fn cluster_state(port: u16) -> String {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return "unreachable".into();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"CLUSTER INFO\r\n").is_err() {
        return "unwritable".into();
    }
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
        // cluster_slots_assigned is the line after cluster_state.
        if String::from_utf8_lossy(&out).contains("cluster_slots_assigned") {
            break;
        }
    }
    let text = String::from_utf8_lossy(&out);
    text.lines()
        .find_map(|l| l.strip_prefix("cluster_state:"))
        .unwrap_or("unknown")
        .trim()
        .to_owned()
}
