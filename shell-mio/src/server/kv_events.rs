//! The node-scoped KV-event streams (`--kv-events TENANT=tcp://HOST:PORT`): the
//! sockets only. The node decides what each tenant's stream announces
//! ([`kvwarden_core::kv_publish`]); here each stream's thread stamps the batches with
//! the wall clock, numbers and holds them (the core's `Stream`), sends them on a ZMQ
//! PUB socket at the endpoint, and answers replay requests on a ZMQ ROUTER socket at
//! the next port, as vLLM's own publisher does.

use kvwarden_core::kv_publish::{BlockEvent, END_SEQ, Stream, encode_batch};
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// One stream as the operator configured it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventsEndpoint {
    /// The tenant whose blocks it announces.
    pub tenant: String,
    /// The PUB socket's endpoint: bound when it is a wildcard (`*`, `::`) or `ipc://`,
    /// connected to otherwise (a subscriber that binds, as llm-d's indexer does): the
    /// rule of vLLM's own publisher.
    pub endpoint: String,
    /// The replay ROUTER socket's endpoint (always bound), if any.
    pub replay: Option<String>,
    /// The topic frame of every batch.
    pub topic: String,
}

impl KvEventsEndpoint {
    /// Reads `TENANT=ENDPOINT[,replay=ENDPOINT][,topic=TOPIC]`; the topic defaults to
    /// `kv@node:<hostname>@TENANT`.
    pub fn parse(text: &str, hostname: &str) -> Result<KvEventsEndpoint, String> {
        let usage = "expected TENANT=ENDPOINT[,replay=ENDPOINT][,topic=TOPIC], e.g. \
                     uid-1000=tcp://*:5557,replay=tcp://*:5558";
        let (tenant, rest) = text
            .split_once('=')
            .ok_or_else(|| format!("`{text}`: {usage}"))?;
        if tenant.is_empty() {
            return Err(format!("`{text}`: no tenant; {usage}"));
        }
        let mut parts = rest.split(',');
        let publish = endpoint(text, parts.next().unwrap_or_default(), usage)?;
        let (mut replay, mut topic) = (None, None);
        for option in parts {
            match option.split_once('=') {
                Some(("replay", at)) => replay = Some(endpoint(text, at, usage)?),
                Some(("topic", name)) => topic = Some(name.to_owned()),
                _ => return Err(format!("`{text}`: unknown option `{option}`; {usage}")),
            }
        }
        Ok(KvEventsEndpoint {
            tenant: tenant.to_owned(),
            endpoint: publish,
            replay,
            topic: topic.unwrap_or_else(|| format!("kv@node:{hostname}@{tenant}")),
        })
    }

    /// Whether the PUB socket binds its endpoint (else it connects).
    pub fn binds(&self) -> bool {
        self.endpoint.contains('*')
            || self.endpoint.contains("::")
            || self.endpoint.starts_with("ipc://")
    }
}

/// A ZMQ endpoint the stream may use: `tcp://HOST:PORT` or `ipc://PATH`.
fn endpoint(text: &str, at: &str, usage: &str) -> Result<String, String> {
    let ok = match at.strip_prefix("tcp://") {
        Some(address) => address.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
        }),
        None => at
            .strip_prefix("ipc://")
            .is_some_and(|path| !path.is_empty()),
    };
    if ok {
        Ok(at.to_owned())
    } else {
        Err(format!(
            "`{text}`: `{at}` is not tcp://HOST:PORT (a port 1 to 65535) or ipc://PATH; {usage}"
        ))
    }
}

/// The running streams, in the order the node numbers them. Dropped (the server
/// stops), each stream's last batch is `AllBlocksCleared`: nothing can be loaded from
/// a server that is gone.
pub struct KvEventStreams {
    senders: Vec<Sender<Vec<BlockEvent>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Drop for KvEventStreams {
    fn drop(&mut self) {
        self.senders.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// How long a stream's last batches may take to leave once the server stops.
const LINGER: Duration = Duration::from_millis(500);

/// How long a stream's thread waits for a replay request before it looks for batches.
const TURN: Duration = Duration::from_millis(5);

impl KvEventStreams {
    /// Binds every stream's sockets (an endpoint that cannot be bound fails the start,
    /// naming it), then starts their threads; each opens with `AllBlocksCleared`.
    pub fn bind(endpoints: &[KvEventsEndpoint]) -> Result<KvEventStreams, String> {
        let context = zmq::Context::new();
        let (mut senders, mut threads) = (Vec::new(), Vec::new());
        for endpoint in endpoints {
            let socket = |kind, at: &str, bind: bool| {
                let socket = context.socket(kind).map_err(|e| e.to_string())?;
                socket
                    .set_linger(LINGER.as_millis() as i32)
                    .map_err(|e| e.to_string())?;
                socket.set_sndhwm(100_000).map_err(|e| e.to_string())?;
                let done = if bind {
                    socket.bind(at)
                } else {
                    socket.connect(at)
                };
                done.map_err(|error| {
                    format!(
                        "--kv-events {}: cannot {} {at}: {error} (is the port free, the \
                         address this host's, the path's directory there?)",
                        endpoint.tenant,
                        if bind { "bind" } else { "connect to" }
                    )
                })?;
                Ok::<_, String>(socket)
            };
            let publisher = socket(zmq::PUB, &endpoint.endpoint, endpoint.binds())?;
            let replay = match &endpoint.replay {
                Some(at) => Some(socket(zmq::ROUTER, at, true)?),
                None => None,
            };
            let (sender, receiver) = channel();
            let topic = endpoint.topic.clone().into_bytes();
            let thread = std::thread::Builder::new()
                .name(format!("kv-events {}", endpoint.tenant))
                .spawn(move || serve(publisher, replay, topic, receiver))
                .map_err(|e| format!("--kv-events: cannot start its thread: {e}"))?;
            threads.push(thread);
            tracing::info!(
                tenant = %endpoint.tenant,
                endpoint = %endpoint.endpoint,
                replay = endpoint.replay.as_deref().unwrap_or("none"),
                bound = endpoint.binds(),
                topic = %endpoint.topic,
                "publishing the tenant's blocks as KV events"
            );
            senders.push(sender);
        }
        Ok(KvEventStreams { senders, threads })
    }

    /// Hands stream `stream` a batch of events.
    pub fn send(&self, stream: usize, events: Vec<BlockEvent>) {
        if let Some(sender) = self.senders.get(stream)
            && sender.send(events).is_err()
        {
            tracing::warn!(
                stream,
                "a KV-events stream's thread is gone: its events are lost"
            );
        }
    }
}

fn now_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A stream's thread: publishes each batch the loop hands it, answers replays, and
/// ends when the server drops its sender.
fn serve(
    publisher: zmq::Socket,
    replay: Option<zmq::Socket>,
    topic: Vec<u8>,
    batches: Receiver<Vec<BlockEvent>>,
) {
    let mut stream = Stream::new();
    let send = |stream: &mut Stream, payload: Vec<u8>| {
        let seq = stream.push(payload.clone());
        if let Err(error) = publisher.send_multipart([&topic[..], &seq, &payload], 0) {
            tracing::warn!(%error, "a KV-events batch could not be published");
        }
    };
    send(&mut stream, Stream::opening(now_seconds()));
    loop {
        match &replay {
            Some(replay) => {
                if replay
                    .poll(zmq::POLLIN, TURN.as_millis() as i64)
                    .unwrap_or(0)
                    > 0
                    && let Ok(frames) = replay.recv_multipart(zmq::DONTWAIT)
                {
                    answer_replay(replay, &stream, &topic, &frames);
                }
            }
            None => std::thread::sleep(TURN),
        }
        // Everything the loop handed over since the last turn goes out as one batch:
        // one message however many inputs made the events.
        let mut events = Vec::new();
        loop {
            match batches.try_recv() {
                Ok(more) => events.extend(more),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    send(&mut stream, Stream::closing(now_seconds(), events));
                    return;
                }
            }
        }
        if !events.is_empty() {
            send(&mut stream, encode_batch(now_seconds(), &events));
        }
    }
}

/// A replay request is `[client, "", start_seq]` (a DEALER's or REQ's); it gets every
/// batch held from `start_seq` on, then the end marker.
fn answer_replay(replay: &zmq::Socket, stream: &Stream, topic: &[u8], frames: &[Vec<u8>]) {
    let (Some(client), Some(start)) = (frames.first(), frames.last()) else {
        return;
    };
    for (seq, payload) in stream.replay(start) {
        let _ = replay.send_multipart([&client[..], b"", topic, &seq, payload], 0);
    }
    let _ = replay.send_multipart([&client[..], b"", b"", &END_SEQ, b""], 0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_reads_its_tenant_sockets_and_topic_and_a_bad_one_is_named() {
        let parsed =
            KvEventsEndpoint::parse("team-a=tcp://*:5557,replay=tcp://*:5558", "gpu-7").unwrap();
        assert_eq!(
            parsed,
            KvEventsEndpoint {
                tenant: "team-a".into(),
                endpoint: "tcp://*:5557".into(),
                replay: Some("tcp://*:5558".into()),
                topic: "kv@node:gpu-7@team-a".into(),
            }
        );
        assert!(parsed.binds(), "a wildcard is bound");
        let connect =
            KvEventsEndpoint::parse("uid-0=tcp://indexer:5557,topic=kv@x@m", "h").unwrap();
        assert_eq!(
            (connect.topic.as_str(), connect.replay.as_deref()),
            ("kv@x@m", None)
        );
        assert!(!connect.binds(), "a subscriber's address is connected to");
        assert!(
            KvEventsEndpoint::parse("a=ipc:///run/kv", "h")
                .unwrap()
                .binds()
        );
        for (bad, names) in [
            ("tcp://0.0.0.0:5557", "TENANT="),
            ("=tcp://0.0.0.0:5557", "no tenant"),
            ("a=udp://host:1", "is not tcp://HOST:PORT"),
            ("a=tcp://host", "is not tcp://HOST:PORT"),
            ("a=tcp://host:0", "a port 1 to 65535"),
            ("a=tcp://:5", "is not tcp://HOST:PORT"),
            ("a=tcp://h:1,replay=tcp://h:x", "`tcp://h:x` is not"),
            ("a=tcp://host:1,hwm=3", "unknown option `hwm=3`"),
        ] {
            let error = KvEventsEndpoint::parse(bad, "h").unwrap_err();
            assert!(error.contains(names), "{bad}: {error}");
        }
    }
}
