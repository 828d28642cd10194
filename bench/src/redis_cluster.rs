//! Real Redis processes on loopback, for the benchmarks and the end-to-end tests (which
//! use it through `kvwarden_bench::redis_cluster`): a Redis Cluster (masters and
//! replicas, `cluster-node-timeout` [`CLUSTER_NODE_TIMEOUT_MS`]) or one plain Redis,
//! each node in a directory of a temporary directory, with no persistence
//! (`--save '' --appendonly no`). A [`RedisCluster`] is always torn down: dropping it
//! SIGKILLs every Redis process it started (stopped ones included) and removes the
//! directory, and the kernel kills them should this process die first.
//!
//! Also the pieces: [`server_command`] (a `redis-server` command line, as the S1
//! baseline starts its own), [`cli`] (one `redis-cli` command), [`wait_until`] and
//! [`free_port_pair`].
//!
//! [`Security`] starts one with a password (`requirepass`, `masterauth`) and/or TLS only
//! (`--port 0 --tls-port P`, TLS on the cluster bus and replication too) with a
//! throwaway CA made by `openssl` in its directory ([`TlsFiles`]): the server
//! certificates name `IP:127.0.0.1`; a client certificate, and a second CA that signed
//! nothing, are there for the tests.

use super::BenchError;
use super::process::{START_BOUND, TempDir, die_with_parent};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `cluster-node-timeout` of every cluster started here: a failed master is replaced
/// within a few seconds.
pub const CLUSTER_NODE_TIMEOUT_MS: u64 = 1000;

/// The programs a [`RedisCluster`] runs.
pub const REDIS_PROGRAMS: [&str; 2] = ["redis-server", "redis-cli"];

/// How the Redis processes of a [`RedisCluster`] are reached.
#[derive(Clone, Debug, Default)]
pub struct Security {
    /// `requirepass` (and `masterauth`) of every node.
    pub password: Option<String>,
    /// TLS only, with a throwaway CA; `Some(true)`: clients must present a certificate
    /// (`tls-auth-clients yes`), `Some(false)`: they may (`optional`).
    pub tls: Option<bool>,
}

/// The PEM files of a TLS [`RedisCluster`], in its directory.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// The CA that signed every certificate here.
    pub ca: PathBuf,
    /// The servers' certificate (`subjectAltName=IP:127.0.0.1`) and key.
    pub server_cert: PathBuf,
    /// The servers' key.
    pub server_key: PathBuf,
    /// A client certificate the CA signed, for mutual TLS.
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
    /// Another CA, which signed nothing here: a client that trusts only it must refuse
    /// the servers.
    pub other_ca: PathBuf,
}

/// Runs `openssl args` in `dir`; its stderr in the error when it fails.
fn openssl(dir: &Path, args: &[&str]) -> Result<(), BenchError> {
    let output = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .map_err(BenchError::io("running openssl"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(BenchError::Failed(format!(
            "openssl {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        )))
    }
}

impl TlsFiles {
    /// Makes the CAs and certificates in `dir` with `openssl`.
    pub fn make(dir: &Path) -> Result<TlsFiles, BenchError> {
        require(&["openssl"]).map_err(|_| {
            BenchError::Failed(
                "`openssl` is not on PATH: the TLS tests make a throwaway CA with it; install \
                 it with `apt-get install -y openssl` (Debian/Ubuntu) or `brew install \
                 openssl`"
                    .into(),
            )
        })?;
        let files = TlsFiles {
            ca: dir.join("ca.crt"),
            server_cert: dir.join("server.crt"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.crt"),
            client_key: dir.join("client.key"),
            other_ca: dir.join("other-ca.crt"),
        };
        let ext = dir.join("san.ext");
        std::fs::write(&ext, "subjectAltName=IP:127.0.0.1\n")
            .map_err(BenchError::io("writing the certificates' extension file"))?;
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        let run = |args: &[&str]| openssl(dir, args);
        for (name, subject) in [
            ("ca", "/CN=kvwarden test CA"),
            ("other-ca", "/CN=not the CA"),
        ] {
            let (key, cert) = (format!("{name}.key"), format!("{name}.crt"));
            let mut args = vec!["req", "-x509"];
            args.extend(ec);
            args.extend([
                "-keyout", &key, "-out", &cert, "-days", "2", "-subj", subject,
            ]);
            run(&args)?;
        }
        for name in ["server", "client"] {
            let (key, csr, cert) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("{name}.crt"),
            );
            let mut args = vec!["req"];
            args.extend(ec);
            args.extend(["-keyout", &key, "-out", &csr, "-subj", "/CN=127.0.0.1"]);
            run(&args)?;
            run(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &cert,
                "-days",
                "2",
                "-extfile",
                "san.ext",
            ])?;
        }
        Ok(files)
    }
}

impl Security {
    /// The `redis-cli` arguments that reach a node: TLS with the CA (and the client
    /// certificate), the password through `REDISCLI_AUTH` (see [`Security::cli`]).
    fn cli_args(&self, tls: Option<&TlsFiles>) -> Vec<String> {
        let mut args = Vec::new();
        if let Some(files) = tls {
            args.push("--tls".to_string());
            for (flag, path) in [
                ("--cacert", &files.ca),
                ("--cert", &files.client_cert),
                ("--key", &files.client_key),
            ] {
                args.push(flag.to_string());
                args.push(path.display().to_string());
            }
        }
        args
    }

    /// A `redis-cli -h 127.0.0.1 -p port` command that reaches a node secured so.
    pub fn cli(&self, tls: Option<&TlsFiles>, port: u16) -> Command {
        let mut command = Command::new("redis-cli");
        command
            .args(["-h", "127.0.0.1", "-p", &port.to_string()])
            .args(self.cli_args(tls))
            .stdin(Stdio::null());
        if let Some(password) = &self.password {
            command.env("REDISCLI_AUTH", password);
        }
        command
    }
}

/// Whether `program` is an executable on `PATH`.
pub fn on_path(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            std::fs::metadata(dir.join(program))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// `Ok` when every one of `programs` is on `PATH`; else an error that names the first
/// missing one and says how to install Redis.
pub fn require(programs: &[&str]) -> Result<(), BenchError> {
    match programs.iter().find(|program| !on_path(program)) {
        None => Ok(()),
        Some(program) => Err(BenchError::Failed(format!(
            "`{program}` is not on PATH: install Redis >= 7 with `apt-get install -y \
             redis-server` (Debian/Ubuntu; it brings redis-server and redis-cli), or \
             `brew install redis` on macOS"
        ))),
    }
}

/// A `redis-server` command as every Redis started here runs: in the foreground, in
/// `dir`, with no persistence (`--save '' --appendonly no`), stdin closed, and killed by
/// the kernel should the thread that spawns it die first. The caller adds where it
/// listens and where its output goes.
pub fn server_command(dir: &Path) -> Command {
    let mut command = Command::new("redis-server");
    command
        .arg("--dir")
        .arg(dir)
        .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
        .stdin(Stdio::null());
    die_with_parent(&mut command);
    command
}

/// Runs `redis-cli -h 127.0.0.1 -p port args…` and returns its stdout, or `None` when
/// it failed.
pub fn cli(port: u16, args: &[&str]) -> Option<String> {
    cli_secured(&Security::default(), None, port, args)
}

/// [`cli`] against a node secured by `security` (with `tls` its files).
pub fn cli_secured(
    security: &Security,
    tls: Option<&TlsFiles>,
    port: u16,
    args: &[&str],
) -> Option<String> {
    let output = security
        .cli(tls, port)
        .args(args)
        .stderr(Stdio::null())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Polls `condition` until it returns `Some`, for up to [`START_BOUND`]; the error names
/// `what`.
pub fn wait_until<T>(
    what: &str,
    mut condition: impl FnMut() -> Option<T>,
) -> Result<T, BenchError> {
    let started = Instant::now();
    loop {
        if let Some(value) = condition() {
            return Ok(value);
        }
        if started.elapsed() > START_BOUND {
            return Err(BenchError::Failed(format!(
                "timed out after {START_BOUND:?} waiting for {what}"
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Attempts at starting one Redis node, each on a fresh port pair.
const PORT_ATTEMPTS: usize = 20;

/// Waits (up to [`START_BOUND`]) until `redis-server` `child` answers on `port` with its
/// own pid: `Ok(true)`. `Ok(false)` when it exited first or another process answers on
/// `port`: the port was taken.
#[cfg(test)]
fn answers_as_itself(child: &mut Child, port: u16) -> Result<bool, BenchError> {
    answers_as_itself_secured(child, port, &Security::default(), None)
}

fn answers_as_itself_secured(
    child: &mut Child,
    port: u16,
    security: &Security,
    tls: Option<&TlsFiles>,
) -> Result<bool, BenchError> {
    let own = format!("process_id:{}", child.id());
    let started = Instant::now();
    loop {
        if let Ok(Some(_exited)) = child.try_wait() {
            return Ok(false);
        }
        if let Some(info) = cli_secured(security, tls, port, &["info", "server"]) {
            return Ok(info.lines().any(|line| line.trim() == own));
        }
        if started.elapsed() > START_BOUND {
            return Err(BenchError::Failed(format!(
                "timed out after {START_BOUND:?} waiting for redis-server on port {port} to \
                 answer"
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A free loopback port whose cluster-bus port (port + 10000) is free too, and neither
/// in `taken`.
pub fn free_port_pair(taken: &[u16]) -> Result<u16, BenchError> {
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
            return Ok(port);
        }
    }
    Err(BenchError::Failed(
        "no free pair of loopback ports (port, port + 10000) for a Redis node".into(),
    ))
}

/// One `redis-server` process of a [`RedisCluster`].
#[derive(Debug)]
pub struct RedisNode {
    /// Its client port on 127.0.0.1.
    pub port: u16,
    /// The process; `None` once killed.
    child: Option<Child>,
}

/// A Redis Cluster, or one plain Redis, on loopback; torn down when dropped.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisNode>,
    dir: TempDir,
    security: Security,
    tls: Option<TlsFiles>,
}

impl RedisCluster {
    /// Starts `masters` masters with `replicas` replicas each (`cluster-node-timeout`
    /// [`CLUSTER_NODE_TIMEOUT_MS`]), creates the cluster with `redis-cli --cluster
    /// create` and waits until every node says `cluster_state:ok` and every replica is
    /// in sync with its master.
    pub fn start(masters: usize, replicas: usize) -> Result<RedisCluster, BenchError> {
        RedisCluster::start_with_node_timeout(masters, replicas, CLUSTER_NODE_TIMEOUT_MS)
    }

    /// [`RedisCluster::start`] with `cluster-node-timeout` `node_timeout_ms`.
    pub fn start_with_node_timeout(
        masters: usize,
        replicas: usize,
        node_timeout_ms: u64,
    ) -> Result<RedisCluster, BenchError> {
        RedisCluster::start_secured(masters, replicas, node_timeout_ms, Security::default())
    }

    /// [`RedisCluster::start_with_node_timeout`], reached as `security` says.
    pub fn start_secured(
        masters: usize,
        replicas: usize,
        node_timeout_ms: u64,
        security: Security,
    ) -> Result<RedisCluster, BenchError> {
        if masters < 3 {
            return Err(BenchError::Failed(format!(
                "a Redis Cluster needs at least 3 masters, {masters} asked"
            )));
        }
        let cluster =
            RedisCluster::launch(masters * (1 + replicas), Some(node_timeout_ms), security)?;
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
        let port = cluster.nodes.first().map_or(0, |node| node.port);
        let output = cluster
            .cli_command(port)
            .args(&create)
            .output()
            .map_err(BenchError::io("running redis-cli --cluster create"))?;
        if !output.status.success() {
            return Err(BenchError::Failed(format!(
                "redis-cli {} failed: {}{}",
                create.join(" "),
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )));
        }
        cluster.wait_ok()?;
        Ok(cluster)
    }

    /// Starts one plain Redis (cluster support off) on a loopback port.
    pub fn single() -> Result<RedisCluster, BenchError> {
        RedisCluster::launch(1, None, Security::default())
    }

    /// [`RedisCluster::single`], reached as `security` says.
    pub fn single_secured(security: Security) -> Result<RedisCluster, BenchError> {
        RedisCluster::launch(1, None, security)
    }

    /// A `redis-cli -h 127.0.0.1 -p port` command that reaches this cluster's nodes
    /// (TLS, password) as they are secured.
    pub fn cli_command(&self, port: u16) -> Command {
        self.security.cli(self.tls.as_ref(), port)
    }

    /// [`cli`] against this cluster's node on `port`, secured as it is.
    pub fn cli(&self, port: u16, args: &[&str]) -> Option<String> {
        cli_secured(&self.security, self.tls.as_ref(), port, args)
    }

    /// The TLS files, when it was started with TLS.
    pub fn tls_files(&self) -> Option<&TlsFiles> {
        self.tls.as_ref()
    }

    /// Starts `count` redis-server processes (cluster nodes with this
    /// `cluster-node-timeout`, or plain), each answering on a port of its own.
    fn launch(
        count: usize,
        node_timeout_ms: Option<u64>,
        security: Security,
    ) -> Result<RedisCluster, BenchError> {
        require(&REDIS_PROGRAMS)?;
        let dir = TempDir::new("redis")?;
        let tls = match security.tls {
            Some(_) => Some(TlsFiles::make(dir.path())?),
            None => None,
        };
        let mut cluster = RedisCluster {
            nodes: Vec::new(),
            dir,
            security,
            tls,
        };
        let mut taken = Vec::new();
        for _ in 0..count {
            let node = cluster.start_node(&mut taken, node_timeout_ms)?;
            cluster.nodes.push(node);
        }
        Ok(cluster)
    }

    /// Starts one node on a free port pair and waits until it answers as itself (its
    /// `INFO server` names its own pid). A port found free can be taken by another
    /// process before `redis-server` binds it (a concurrent test's Redis, or an outgoing
    /// connection's ephemeral port on the cluster-bus port): then this node exits, or
    /// another process answers on its port, and the node is started again on another
    /// pair, up to [`PORT_ATTEMPTS`] times. Without this check two clusters started at
    /// once could share a node and merge into one.
    fn start_node(
        &self,
        taken: &mut Vec<u16>,
        node_timeout_ms: Option<u64>,
    ) -> Result<RedisNode, BenchError> {
        let mut lost = Vec::new();
        for _ in 0..PORT_ATTEMPTS {
            let port = free_port_pair(taken)?;
            taken.extend([port, port + 10_000]);
            let node_dir = self.dir.path().join(port.to_string());
            std::fs::create_dir_all(&node_dir)
                .map_err(BenchError::io("creating a Redis node's directory"))?;
            let log_path = node_dir.join("stdout.log");
            let log = std::fs::File::create(&log_path)
                .map_err(BenchError::io("creating a Redis node's log file"))?;
            let mut command = server_command(&node_dir);
            match (&self.tls, self.security.tls) {
                (Some(files), Some(require_client_cert)) => {
                    command
                        .args(["--port", "0", "--tls-port", &port.to_string()])
                        .args(["--tls-cluster", "yes", "--tls-replication", "yes"])
                        .arg("--tls-cert-file")
                        .arg(&files.server_cert)
                        .arg("--tls-key-file")
                        .arg(&files.server_key)
                        .arg("--tls-ca-cert-file")
                        .arg(&files.ca)
                        .args([
                            "--tls-auth-clients",
                            if require_client_cert {
                                "yes"
                            } else {
                                "optional"
                            },
                        ]);
                }
                _ => {
                    command.args(["--port", &port.to_string()]);
                }
            }
            if let Some(password) = &self.security.password {
                command
                    .args(["--requirepass", password])
                    .args(["--masterauth", password]);
            }
            command.args(["--bind", "127.0.0.1", "--protected-mode", "no"]);
            if let Some(node_timeout_ms) = node_timeout_ms {
                command
                    .args(["--cluster-enabled", "yes"])
                    .args(["--cluster-config-file", "nodes.conf"])
                    .args(["--cluster-node-timeout", &node_timeout_ms.to_string()])
                    // A replica takes over however long it was cut off; the fault
                    // figures and tests kill masters on purpose.
                    .args(["--cluster-replica-validity-factor", "0"])
                    .args(["--cluster-require-full-coverage", "no"]);
            }
            let mut child = command
                .stdout(
                    log.try_clone()
                        .map_err(BenchError::io("cloning a Redis node's log file"))?,
                )
                .stderr(log)
                .spawn()
                .map_err(BenchError::io("spawning redis-server"))?;
            if answers_as_itself_secured(&mut child, port, &self.security, self.tls.as_ref())
                .map_err(|error| {
                    let _ = child.kill();
                    let _ = child.wait();
                    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                    BenchError::Failed(format!("{error}; its log:\n{log}"))
                })?
            {
                return Ok(RedisNode {
                    port,
                    child: Some(child),
                });
            }
            let _ = child.kill();
            let _ = child.wait();
            lost.push(port);
        }
        Err(BenchError::Failed(format!(
            "no redis-server kept a port of its own in {PORT_ATTEMPTS} attempts: ports \
             {lost:?} were each taken by another process first (their logs are in {})",
            self.dir.path().display()
        )))
    }

    /// Waits until every live node says `cluster_state:ok` and every live replica's link
    /// to its master is up.
    pub fn wait_ok(&self) -> Result<(), BenchError> {
        for port in self.live_ports() {
            wait_until(&format!("cluster_state:ok on port {port}"), || {
                self.cli(port, &["cluster", "info"])
                    .filter(|info| info.contains("cluster_state:ok"))
            })?;
            wait_until(&format!("the replica on port {port} in sync"), || {
                self.cli(port, &["info", "replication"]).filter(|info| {
                    info.contains("role:master") || info.contains("master_link_status:up")
                })
            })?;
        }
        Ok(())
    }

    /// `redis://127.0.0.1:PORT` (`rediss://` with TLS) of every node started (live or not).
    pub fn seeds(&self) -> Vec<String> {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        self.nodes
            .iter()
            .map(|node| format!("{scheme}://127.0.0.1:{}", node.port))
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
                self.cli(*port, &["role"])
                    .is_some_and(|role| role.starts_with("master"))
            })
            .collect()
    }

    /// The port of the live replica of the master on `master`, by its
    /// `INFO replication`.
    pub fn replica_of(&self, master: u16) -> Option<u16> {
        let needle = format!("master_port:{master}");
        self.live_ports().into_iter().find(|port| {
            self.cli(*port, &["info", "replication"])
                .is_some_and(|info| info.lines().any(|line| line.trim() == needle))
        })
    }

    /// What every live node says of the cluster (`CLUSTER NODES`), for a failure
    /// message.
    pub fn describe(&self) -> String {
        self.live_ports()
            .into_iter()
            .map(|port| {
                let nodes = self
                    .cli(port, &["cluster", "nodes"])
                    .unwrap_or_else(|| "(no answer to CLUSTER NODES)\n".into());
                format!("node {port} sees:\n{nodes}")
            })
            .collect()
    }

    /// Sends `signal` to every live node.
    pub fn signal_all(&self, signal: rustix::process::Signal) {
        for child in self.nodes.iter().filter_map(|node| node.child.as_ref()) {
            super::process::signal(child, signal);
        }
    }

    /// SIGSTOPs every live node.
    pub fn stop_all(&self) {
        self.signal_all(rustix::process::Signal::STOP);
    }

    /// SIGCONTs every live node.
    pub fn cont_all(&self) {
        self.signal_all(rustix::process::Signal::CONT);
    }

    /// SIGKILLs the node on `port` (if still live) and reaps it; false when no node was
    /// started on `port`.
    pub fn kill(&mut self, port: u16) -> bool {
        let Some(node) = self.nodes.iter_mut().find(|node| node.port == port) else {
            return false;
        };
        if let Some(mut child) = node.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        true
    }

    /// The directory holding every node's files and its log (`PORT/stdout.log`).
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Both ways a port can turn out taken, and the way it does not: a second
    /// `redis-server` on a port the first holds exits (not its own), a process that is
    /// not the one answering is told apart by pid (not its own), and the first is its own.
    #[test]
    fn a_node_counts_as_started_only_when_it_answers_on_its_port_as_itself() {
        if let Err(error) = require(&REDIS_PROGRAMS) {
            panic!("{error}; `.ci/run` installs Redis by itself");
        }
        let first = RedisCluster::single().expect("a plain Redis");
        let port = first.nodes[0].port;

        let dir = TempDir::new("redis-second").expect("a directory");
        let mut second = server_command(dir.path())
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawning a second redis-server");
        assert!(!answers_as_itself(&mut second, port).expect("an answer"));
        let _ = second.kill();
        let _ = second.wait();

        let mut bystander = Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawning sleep");
        assert!(!answers_as_itself(&mut bystander, port).expect("an answer"));
        let _ = bystander.kill();
        let _ = bystander.wait();

        let mut first = first;
        let mut own = first.nodes[0]
            .child
            .take()
            .expect("the first node's process");
        assert!(answers_as_itself(&mut own, port).expect("an answer"));
        let _ = own.kill();
        let _ = own.wait();
    }
}
