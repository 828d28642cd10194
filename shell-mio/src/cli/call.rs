//! `kvwarden call`: one raw request, the reply printed as JSON.

use crate::client::{Client, ClientError};
use crate::server::status::{ids_as_strings, json_to_msgpack, msgpack_to_json};
use std::process::ExitCode;

/// Flags of `kvwarden call`.
#[derive(Debug, clap::Args)]
pub struct CallArgs {
    #[command(flatten)]
    endpoint: super::EndpointArgs,
    /// The op, e.g. `status` or `ping`. Ops naming an instance are `forbidden` here:
    /// only the worker that registered an instance (it holds its secret) may act on it.
    op: String,
    /// The args as a JSON array, e.g. `[123]`.
    #[arg(default_value = "[]")]
    args: String,
}

/// Sends the request and prints the reply as JSON: exit 0 for an ok reply, 3 for an
/// error reply (printed all the same), 1 when no reply came, 2 for bad arguments.
pub fn run(args: CallArgs) -> ExitCode {
    let parsed: serde_json::Value = match serde_json::from_str(&args.args) {
        Ok(serde_json::Value::Array(items)) => serde_json::Value::Array(items),
        _ => {
            eprintln!(
                "kvwarden call: args must be a JSON array, e.g. '[123]', got {:?}",
                args.args
            );
            return ExitCode::from(2);
        }
    };
    let rmpv::Value::Array(request_args) = json_to_msgpack(&parsed) else {
        return ExitCode::from(2);
    };
    let config = match args.endpoint.client_config() {
        Ok(config) => config,
        Err(message) => {
            eprintln!("kvwarden call: {message}");
            return ExitCode::from(2);
        }
    };
    let client = match Client::connect(config) {
        Ok(client) => client,
        Err(error) => {
            eprintln!("kvwarden call: {}", super::connect_error(&error));
            return ExitCode::from(1);
        }
    };
    let (mut printed, code) = match client.call(&args.op, request_args) {
        Ok(value) => (
            serde_json::json!({"ok": true, "value": msgpack_to_json(&value)}),
            ExitCode::SUCCESS,
        ),
        Err(ClientError::Server { error, .. }) => {
            if error.code.as_str() == "bad_args" {
                // The CLI said `hello` in this build's protocol already: the arguments
                // are what is wrong, not the versions.
                eprintln!(
                    "kvwarden call: `{}` refused its args {}: give them as one JSON array \
                     after the op, in the form the message names (e.g. kvwarden call ping \
                     '[null]')",
                    args.op, args.args
                );
            }
            (
                serde_json::json!({
                    "ok": false, "code": error.code.as_str(), "message": error.message,
                }),
                ExitCode::from(3),
            )
        }
        Err(error) => {
            eprintln!("kvwarden call: {error}");
            return ExitCode::from(1);
        }
    };
    // Ids (`hello`'s `boot_id`, say) as strings, as `GET /status` shows them.
    ids_as_strings(&mut printed);
    println!("{printed}");
    code
}
