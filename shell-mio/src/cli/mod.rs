//! The server's commands: `kvwarden serve | status | worker | call`. The `kvwarden`
//! binary (crate `kvwarden-cli`) adds the drivers that spawn servers and workers of
//! their own (`demo`, `bench`, `gpu`), so that this crate never links the bench.

mod call;
mod serve;
pub mod status;
mod subuid;
mod worker;

use clap::Subcommand;
use std::process::ExitCode;

/// The server's own commands; the `kvwarden` binary flattens them into its command line.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the server (Unix socket, optional TCP, HTTP status/metrics).
    Serve(Box<serve::ServeArgs>),
    /// Print a running server's status as a table (or JSON).
    Status(status::StatusArgs),
    /// Run a worker process: memfd buffers, heartbeat, store/retrieve traffic.
    Worker(worker::WorkerArgs),
    /// Send one raw request and print the reply as JSON (for debugging and tests).
    Call(call::CallArgs),
}

impl Command {
    /// The log level when `RUST_LOG` does not say: the long-running commands log what
    /// they do, the others only what goes wrong.
    pub fn default_log_level(&self) -> &'static str {
        match self {
            Command::Serve(_) | Command::Worker(_) => "info",
            Command::Status(_) | Command::Call(_) => "warn",
        }
    }

    /// Runs the command.
    pub fn run(self) -> ExitCode {
        match self {
            Command::Serve(args) => serve::run(*args),
            Command::Status(args) => status::run(args),
            Command::Worker(args) => worker::run(args),
            Command::Call(args) => call::run(args),
        }
    }
}

/// Logs to stderr at `default_level` unless `RUST_LOG` says otherwise (colours only on
/// a terminal).
pub fn init_logging(default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// The endpoint flags shared by the client commands.
#[derive(Debug, clap::Args)]
pub struct EndpointArgs {
    /// The server's Unix socket [default: $XDG_RUNTIME_DIR/kvwarden.sock, else
    /// /tmp/kvwarden-<uid>/kvwarden.sock].
    #[arg(long, conflicts_with = "tcp")]
    socket: Option<std::path::PathBuf>,
    /// Connect over TCP instead (no memfd buffers, no process-exit proof); needs
    /// --tcp-token-file.
    #[arg(long, requires = "tcp_token_file")]
    tcp: Option<std::net::SocketAddr>,
    /// The file holding the server's TCP token (its --tcp-token-file), for --tcp.
    #[arg(long, value_name = "PATH")]
    tcp_token_file: Option<std::path::PathBuf>,
    /// Trust a server running as this uid (besides root and your own): without it the
    /// client refuses, before sending anything, a socket answered by any other user.
    #[arg(long = "trust-server-uid", value_name = "UID")]
    trust_server_uids: Vec<u32>,
}

impl EndpointArgs {
    /// The client settings these flags name: the endpoint, the TCP token (read from
    /// its file), the server uids trusted.
    fn client_config(&self) -> Result<crate::client::ClientConfig, String> {
        let mut config = crate::client::ClientConfig::new(self.endpoint());
        if let Some(path) = &self.tcp_token_file {
            config.tcp_token = Some(
                crate::client::ClientConfig::read_tcp_token_file(path)
                    .map_err(|e| e.to_string())?,
            );
        }
        config.trusted_server_uids = self.trust_server_uids.clone();
        Ok(config)
    }

    fn endpoint(&self) -> crate::client::Endpoint {
        match (&self.tcp, &self.socket) {
            (Some(addr), _) => crate::client::Endpoint::Tcp(*addr),
            (None, Some(path)) => crate::client::Endpoint::Unix(path.clone()),
            (None, None) => {
                crate::client::Endpoint::Unix(crate::server::listen::default_socket_path())
            }
        }
    }
}

/// What `status`, `call` and `worker` say when their connection fails: where no server
/// answered and how to start one, when nothing listens there (no socket file, a stale
/// one, a closed port); the error as it is otherwise.
fn connect_error(error: &crate::client::ClientError) -> String {
    use std::io::ErrorKind;
    match error {
        crate::client::ClientError::Io { endpoint, source }
            if matches!(
                source.kind(),
                ErrorKind::NotFound | ErrorKind::ConnectionRefused
            ) =>
        {
            format!(
                "no kvwarden server at {endpoint} ({source}): is the server running? Start \
                 it with `kvwarden serve`, or pass --socket PATH"
            )
        }
        other => other.to_string(),
    }
}

pub use kvwarden_client::parse_bytes;
