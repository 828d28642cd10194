//! A real Redis Cluster (or one plain Redis) on loopback ports, for the L2 tests: started
//! in a temporary directory, created with `redis-cli --cluster create`, and always torn
//! down: dropping it SIGKILLs every Redis process it started (stopped ones included)
//! and removes the directory.

use crate::{PATIENCE, TempDir, wait_for};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// `cluster-node-timeout` of every test cluster: a failed master is replaced within a
/// few seconds.
pub const CLUSTER_NODE_TIMEOUT_MS: u64 = 1000;

/// One `redis-server` process.
pub struct RedisNode {
    /// Its client port on 127.0.0.1.
    pub port: u16,
    /// The process; `None` once killed.
    child: Option<Child>,
}

/// A Redis Cluster, or one plain Redis, owned by a test.
pub struct RedisCluster {
    nodes: Vec<RedisNode>,
    dir: TempDir,
}

/// The path of `program`, or a panic that says how to install it.
fn require(program: &str) -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(program))
            .find(|candidate| candidate.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "`{program}` is not on PATH: the L2 tests need a real Redis. Install it with \
             `sudo apt-get install -y redis-server` (Debian/Ubuntu; it brings redis-server \
             and redis-cli, Redis ≥ 7), or `brew install redis` on macOS; `.ci/run` installs \
             it by itself"
        )
    })
}

/// A free loopback port whose cluster-bus port (port + 10000) is free too.
fn free_port_pair(taken: &[u16]) -> u16 {
    for _ in 0..10_000 {
        let Ok(listener) = TcpListener::bind("127.0.0.1:0") else {
            continue;
        };
        let Ok(port) = listener.local_addr().map(|address| address.port()) else {
            continue;
        };
        if port > 55_535 || taken.contains(&port) || taken.contains(&(port + 10_000)) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free pair of loopback ports (port, port + 10000) for a Redis node");
}

/// Runs `redis-cli -p port args…` and returns its stdout, or `None` when it failed.
fn cli_output(port: u16, args: &[&str]) -> Option<String> {
    let output = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

impl RedisCluster {
    /// Starts `masters` masters with `replicas` replicas each (`cluster-node-timeout`
    /// [`CLUSTER_NODE_TIMEOUT_MS`]), creates the cluster and waits until every node says
    /// `cluster_state:ok` and every replica is in sync with its master.
    pub fn start(masters: usize, replicas: usize) -> RedisCluster {
        assert!(
            masters >= 3,
            "a Redis Cluster needs at least 3 masters, {masters} asked"
        );
        require("redis-cli");
        let cluster = RedisCluster::launch(masters * (1 + replicas), true);
        let mut create: Vec<String> = vec!["--cluster".into(), "create".into()];
        create.extend(
            cluster
                .nodes
                .iter()
                .map(|node| format!("127.0.0.1:{}", node.port)),
        );
        create.extend([
            "--cluster-replicas".into(),
            replicas.to_string(),
            "--cluster-yes".into(),
        ]);
        let output = Command::new("redis-cli")
            .args(&create)
            .stdin(Stdio::null())
            .output()
            .expect("running redis-cli --cluster create");
        assert!(
            output.status.success(),
            "redis-cli {} failed: {}{}",
            create.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        cluster.wait_ok();
        cluster
    }

    /// Starts one plain Redis (cluster support off).
    pub fn single() -> RedisCluster {
        RedisCluster::launch(1, false)
    }

    /// Starts `count` redis-server processes and waits until each answers PING.
    fn launch(count: usize, cluster_enabled: bool) -> RedisCluster {
        let server = require("redis-server");
        require("redis-cli");
        let mut cluster = RedisCluster {
            nodes: Vec::new(),
            dir: TempDir::new("redis"),
        };
        let mut taken = Vec::new();
        for _ in 0..count {
            let port = free_port_pair(&taken);
            taken.extend([port, port + 10_000]);
            let node_dir = cluster.dir.path().join(port.to_string());
            std::fs::create_dir_all(&node_dir).expect("a Redis node's directory");
            let log = std::fs::File::create(node_dir.join("stdout.log")).expect("a log file");
            let mut command = Command::new(&server);
            command
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .arg("--dir")
                .arg(&node_dir)
                .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
                .args(["--protected-mode", "no"]);
            if cluster_enabled {
                command
                    .args(["--cluster-enabled", "yes"])
                    .args(["--cluster-config-file", "nodes.conf"])
                    .args([
                        "--cluster-node-timeout",
                        &CLUSTER_NODE_TIMEOUT_MS.to_string(),
                    ])
                    // A replica takes over however long it was cut off; a test kills
                    // masters on purpose.
                    .args(["--cluster-replica-validity-factor", "0"])
                    .args(["--cluster-require-full-coverage", "no"]);
            }
            let child = command
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("a log file"))
                .stderr(log)
                .spawn()
                .unwrap_or_else(|error| panic!("starting {}: {error}", server.display()));
            cluster.nodes.push(RedisNode {
                port,
                child: Some(child),
            });
        }
        for node in &cluster.nodes {
            let port = node.port;
            wait_for(
                &format!("redis-server on port {port} to answer PING"),
                PATIENCE,
                || cli_output(port, &["ping"]).filter(|reply| reply.trim() == "PONG"),
            );
        }
        cluster
    }

    /// Waits until every live node says `cluster_state:ok` and every live replica's link
    /// to its master is up.
    pub fn wait_ok(&self) {
        for port in self.live_ports() {
            wait_for(
                &format!("cluster_state:ok on port {port}"),
                PATIENCE,
                || {
                    cli_output(port, &["cluster", "info"])
                        .filter(|info| info.contains("cluster_state:ok"))
                },
            );
            wait_for(
                &format!("the replica on port {port} in sync"),
                PATIENCE,
                || {
                    cli_output(port, &["info", "replication"]).filter(|info| {
                        info.contains("role:master") || info.contains("master_link_status:up")
                    })
                },
            );
        }
    }

    /// `redis://127.0.0.1:PORT` of every node started (live or not).
    pub fn seeds(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|node| format!("redis://127.0.0.1:{}", node.port))
            .collect()
    }

    /// Ports of the nodes not killed.
    pub fn live_ports(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|node| node.child.is_some())
            .map(|node| node.port)
            .collect()
    }

    /// Ports of the live nodes that are masters now.
    pub fn masters(&self) -> Vec<u16> {
        self.live_ports()
            .into_iter()
            .filter(|port| {
                cli_output(*port, &["role"]).is_some_and(|role| role.starts_with("master"))
            })
            .collect()
    }

    /// SIGSTOPs every live node.
    pub fn stop_all(&self) {
        self.signal_all(rustix::process::Signal::STOP);
    }

    /// SIGCONTs every live node.
    pub fn cont_all(&self) {
        self.signal_all(rustix::process::Signal::CONT);
    }

    fn signal_all(&self, signal: rustix::process::Signal) {
        for node in &self.nodes {
            if let Some(child) = &node.child {
                crate::signal(child, signal);
            }
        }
    }

    /// SIGKILLs the node on `port` and reaps it.
    pub fn kill(&mut self, port: u16) {
        let node = self
            .nodes
            .iter_mut()
            .find(|node| node.port == port)
            .unwrap_or_else(|| panic!("no Redis node on port {port}"));
        if let Some(mut child) = node.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The directory holding every node's files and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                // SIGKILL ends a stopped process too.
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        // `dir` is removed when the field drops, after this.
    }
}
