//! A ping load generator: many connections on one mio thread, closed loop (S1) or one
//! ping per connection at a fixed rate (S2, S3, R5), with every round trip recorded.
//!
//! It speaks the wire protocol directly, with each reply frame decoded and checked, so
//! that what is measured is the server and not a client library. One request is in
//! flight per connection at any time; each connection pings its own instance id (or
//! nil: an untracked prober).

use super::BenchError;
use super::stats::Samples;
use crate::protocol::{decode_reply, encode_request, split_frame};
use mio::net::UnixStream;
use mio::{Events, Interest, Poll, Registry, Token};
use rmpv::Value;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io::{self, Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

/// The largest reply frame a ping can get (an error reply with its message).
const MAX_REPLY_BYTES: usize = 64 << 10;
/// How long the outstanding pings may take to come back once a run ends.
const DRAIN_BOUND: Duration = Duration::from_secs(10);

/// When each connection sends its next ping.
#[derive(Copy, Clone, Debug)]
pub enum Pacing {
    /// As soon as the previous reply arrives.
    ClosedLoop,
    /// One ping per connection per interval, at a fixed rate (a ping whose time comes
    /// while the previous one is unanswered goes out as soon as that reply arrives);
    /// the connections' start times are spread evenly over one interval.
    Every(Duration),
}

/// The flags of a fixed-rate ping load measured for a while, shared by the figures
/// that run one (`bench latency`, `bench slow-contexts`).
#[derive(Clone, Debug, clap::Args)]
pub struct PacedPingArgs {
    /// Milliseconds between one worker's pings.
    #[arg(long, default_value_t = 100, value_name = "MS")]
    interval_ms: u64,
    /// Seconds measured (after a warm-up of one interval).
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS")]
    seconds: f64,
}

impl PacedPingArgs {
    /// What a figure does before it starts its server: checks `--seconds` (an error
    /// names a value that is not a positive number of seconds), raises the open-file
    /// limit (a fleet holds a connection per worker) and prints the machine context.
    /// Returns the measured duration and the interval between one worker's pings (at
    /// least 1 ms).
    pub fn begin(&self) -> Result<(Duration, Duration), BenchError> {
        let seconds = super::positive_seconds("--seconds", self.seconds)?;
        super::raise_open_file_limit();
        super::print_machine();
        Ok((seconds, Duration::from_millis(self.interval_ms.max(1))))
    }
}

/// What one run measured.
#[derive(Debug, Default)]
pub struct PingOutcome {
    /// Replies in the measured window.
    pub replies: u64,
    /// Replies `false` (the instance is not tracked) in the window.
    pub untracked: u64,
    /// Error replies in the window.
    pub errors: u64,
    /// The measured window.
    pub elapsed: Duration,
    /// Round trips of the window.
    pub round_trips: Samples,
    /// Every reply of the run, warm-up and drain included (for costs per ping).
    pub all_replies: u64,
}

impl PingOutcome {
    /// Replies per second.
    pub fn throughput(&self) -> f64 {
        self.replies as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// The protocol the fleet speaks.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// kvwarden's: `[id, "ping", [instance]]` frames, each reply decoded.
    Kvwarden,
    /// Redis's RESP: `PING` as a multi-bulk command, `+PONG` expected: the same load
    /// generator against `redis-server`, for a like-for-like S1 baseline.
    Resp,
}

/// `PING` in RESP, and its reply.
const RESP_PING: &[u8] = b"*1\r\n$4\r\nPING\r\n";
const RESP_PONG: &[u8] = b"+PONG\r\n";

/// What a reply said.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Answer {
    Tracked,
    Untracked,
    Error,
}

struct Connection {
    stream: UnixStream,
    wire: Dialect,
    frame: Vec<u8>,
    input: Vec<u8>,
    output: Vec<u8>,
    sent_at: Option<Instant>,
    /// A ping fell due while the previous one was unanswered.
    overdue: bool,
    /// Registered for writability too: only while output waits for socket space.
    /// Asking for it always made every request the server read wake this loop once
    /// more (the freed space raises a writable edge), on the server's CPU as well.
    writable_interest: bool,
    token: Token,
}

impl Connection {
    fn send(&mut self, registry: &Registry, now: Instant) -> io::Result<()> {
        self.sent_at = Some(now);
        self.output.extend_from_slice(&self.frame);
        self.flush(registry)
    }

    fn flush(&mut self, registry: &Registry) -> io::Result<()> {
        while !self.output.is_empty() {
            match self.stream.write(&self.output) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.output.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let want_writable = !self.output.is_empty();
        if want_writable != self.writable_interest {
            let interest = match want_writable {
                true => Interest::READABLE | Interest::WRITABLE,
                false => Interest::READABLE,
            };
            registry.reregister(&mut self.stream, self.token, interest)?;
            self.writable_interest = want_writable;
        }
        Ok(())
    }

    /// Reads what is there; returns the whole replies that arrived.
    fn receive(&mut self, scratch: &mut [u8], replies: &mut Vec<Answer>) -> io::Result<()> {
        loop {
            match self.stream.read(scratch) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                // A short read drained the socket: bytes that arrive later raise a new
                // edge, so the extra read that would only say EAGAIN is skipped.
                Ok(n) if n < scratch.len() => {
                    self.input.extend_from_slice(&scratch[..n]);
                    break;
                }
                Ok(n) => self.input.extend_from_slice(&scratch[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let mut consumed = 0;
        if self.wire == Dialect::Resp {
            while let Some(reply) = self.input.get(consumed..consumed + RESP_PONG.len()) {
                replies.push(match reply == RESP_PONG {
                    true => Answer::Tracked,
                    false => Answer::Error,
                });
                consumed += RESP_PONG.len();
            }
            self.input.drain(..consumed);
            return Ok(());
        }
        loop {
            match split_frame(&self.input[consumed..], MAX_REPLY_BYTES) {
                Ok(Some((body, used))) => {
                    replies.push(match decode_reply(body).map(|r| r.result) {
                        Ok(Ok(Value::Boolean(true))) => Answer::Tracked,
                        Ok(Ok(Value::Boolean(false))) => Answer::Untracked,
                        _ => Answer::Error,
                    });
                    consumed += used;
                }
                Ok(None) => break,
                Err(error) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("a bad reply frame: {error}"),
                    ));
                }
            }
        }
        self.input.drain(..consumed);
        Ok(())
    }
}

/// Connections that ping, held open between runs.
pub struct PingFleet {
    poll: Poll,
    connections: Vec<Connection>,
}

impl PingFleet {
    /// Opens one connection per entry of `instances`; each pings that instance (None:
    /// `ping [nil]`). Prints progress when there are many.
    /// They say no `hello`, as a worker's connection that carries memfds is read: with
    /// `recvmsg`.
    pub fn connect(socket: &Path, instances: &[Option<u64>]) -> Result<PingFleet, BenchError> {
        PingFleet::connect_with(socket, Dialect::Kvwarden, instances, false)
    }

    /// [`PingFleet::connect`], each connection first saying `hello` with `sends_fds:
    /// false` (a client that only pings), so the server reads it with plain `read`.
    pub fn connect_without_fds(
        socket: &Path,
        instances: &[Option<u64>],
    ) -> Result<PingFleet, BenchError> {
        PingFleet::connect_with(socket, Dialect::Kvwarden, instances, true)
    }

    /// `count` connections to a Redis server's Unix socket, each sending `PING`.
    pub fn connect_resp(socket: &Path, count: usize) -> Result<PingFleet, BenchError> {
        PingFleet::connect_with(socket, Dialect::Resp, &vec![None; count], false)
    }

    fn connect_with(
        socket: &Path,
        wire: Dialect,
        instances: &[Option<u64>],
        promise_no_fds: bool,
    ) -> Result<PingFleet, BenchError> {
        let poll = Poll::new().map_err(BenchError::io("creating a poll"))?;
        let mut connections = Vec::with_capacity(instances.len());
        let started = Instant::now();
        for (index, instance) in instances.iter().enumerate() {
            let what = || {
                format!(
                    "opening connection {} of {} to {}",
                    index + 1,
                    instances.len(),
                    socket.display()
                )
            };
            let std_stream = match wire {
                Dialect::Kvwarden => {
                    let mut raw = if promise_no_fds {
                        super::raw::RawConnection::connect_without_fds(socket)?
                    } else {
                        super::raw::RawConnection::open(socket)?
                    };
                    if let Some(instance) = instance {
                        raw.attach(*instance)?;
                    }
                    raw.into_stream()
                }
                Dialect::Resp => std::os::unix::net::UnixStream::connect(socket)
                    .map_err(BenchError::io(what()))?,
            };
            std_stream
                .set_nonblocking(true)
                .map_err(BenchError::io(what()))?;
            let mut stream = UnixStream::from_std(std_stream);
            poll.registry()
                .register(&mut stream, Token(index), Interest::READABLE)
                .map_err(BenchError::io(what()))?;
            let arg = instance.map_or(Value::Nil, Value::from);
            let frame = match wire {
                Dialect::Kvwarden => encode_request(1, "ping", vec![arg]),
                Dialect::Resp => RESP_PING.to_vec(),
            };
            connections.push(Connection {
                stream,
                wire,
                frame,
                input: Vec::new(),
                output: Vec::new(),
                sent_at: None,
                overdue: false,
                writable_interest: false,
                token: Token(index),
            });
            if (index + 1) % 2_000 == 0 && index + 1 < instances.len() {
                super::progress(&format!(
                    "{} connections open ({:.1} s)",
                    index + 1,
                    started.elapsed().as_secs_f64()
                ));
            }
        }
        Ok(PingFleet { poll, connections })
    }

    /// How many connections.
    pub fn len(&self) -> usize {
        self.connections.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.connections.is_empty()
    }

    /// Pings for `warmup + duration`, recording the round trips of pings sent after
    /// the warm-up and answered before the end; then waits for the pings still out.
    pub fn run(
        &mut self,
        pacing: Pacing,
        warmup: Duration,
        duration: Duration,
    ) -> Result<PingOutcome, BenchError> {
        let failed = |e: io::Error| BenchError::Io {
            what: "pinging (a load connection failed; did the server close it?)".into(),
            source: e,
        };
        // A handle of its own: the poll is borrowed mutably while connections send.
        let registry = self.poll.registry().try_clone().map_err(failed)?;
        let registry = &registry;
        let mut round = Round::start(pacing, warmup, duration, &mut self.connections, registry)
            .map_err(failed)?;
        let mut events = Events::with_capacity(1024);
        let mut scratch = vec![0u8; 64 << 10];
        let mut answers = Vec::new();
        loop {
            let now = Instant::now();
            if now >= round.deadline {
                break;
            }
            let next_timer = round
                .send_due(&mut self.connections, registry, now)
                .map_err(failed)?;
            let wait = next_timer.saturating_duration_since(now);
            match self.poll.poll(&mut events, Some(wait)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(failed(e)),
            }
            for event in &events {
                let index = event.token().0;
                let Some(connection) = self.connections.get_mut(index) else {
                    continue;
                };
                if event.is_writable() {
                    connection.flush(registry).map_err(failed)?;
                }
                if !event.is_readable() && !event.is_read_closed() {
                    continue;
                }
                answers.clear();
                connection
                    .receive(&mut scratch, &mut answers)
                    .map_err(failed)?;
                round
                    .answered(connection, &answers, registry)
                    .map_err(failed)?;
            }
        }
        let mut outcome = round.finish(duration);
        outcome.all_replies += self.drain()?;
        Ok(outcome)
    }

    /// Waits until every ping sent has its reply, so that the next run starts clean;
    /// returns how many replies came.
    fn drain(&mut self) -> Result<u64, BenchError> {
        let mut drained = 0;
        let bound = Instant::now() + DRAIN_BOUND;
        let mut events = Events::with_capacity(1024);
        let mut scratch = vec![0u8; 64 << 10];
        let mut answers = Vec::new();
        for connection in &mut self.connections {
            connection.overdue = false;
        }
        while self.connections.iter().any(|c| c.sent_at.is_some()) {
            let now = Instant::now();
            if now >= bound {
                let out = self
                    .connections
                    .iter()
                    .filter(|c| c.sent_at.is_some())
                    .count();
                return Err(BenchError::Failed(format!(
                    "{out} pings still unanswered {DRAIN_BOUND:?} after the run ended"
                )));
            }
            self.poll
                .poll(&mut events, Some(bound - now))
                .or_else(|e| {
                    if e.kind() == io::ErrorKind::Interrupted {
                        Ok(())
                    } else {
                        Err(e)
                    }
                })
                .map_err(BenchError::io("waiting for the last replies"))?;
            for event in &events {
                let Some(connection) = self.connections.get_mut(event.token().0) else {
                    continue;
                };
                let _ = connection.flush(self.poll.registry());
                answers.clear();
                if connection.receive(&mut scratch, &mut answers).is_err() {
                    connection.sent_at = None; // closed: nothing more will come
                    continue;
                }
                if !answers.is_empty() {
                    drained += answers.len() as u64;
                    connection.sent_at = None;
                }
            }
        }
        Ok(drained)
    }
}

/// One run's clock and tally: who pings next and when, and what came back in the
/// measured window.
struct Round {
    pacing: Pacing,
    measured_from: Instant,
    deadline: Instant,
    /// Who pings next, and when (fixed rate only).
    schedule: BinaryHeap<Reverse<(Instant, usize)>>,
    outcome: PingOutcome,
    round_trips_ns: Vec<u64>,
}

impl Round {
    /// Starts a run now: closed loop sends every connection's first ping at once, a
    /// fixed rate spreads their first pings over one interval.
    fn start(
        pacing: Pacing,
        warmup: Duration,
        duration: Duration,
        connections: &mut [Connection],
        registry: &Registry,
    ) -> io::Result<Round> {
        let started = Instant::now();
        let measured_from = started + warmup;
        let count = connections.len().max(1);
        let mut schedule = BinaryHeap::new();
        for (index, connection) in connections.iter_mut().enumerate() {
            match pacing {
                Pacing::ClosedLoop => connection.send(registry, started)?,
                Pacing::Every(interval) => {
                    let offset = interval.mul_f64(index as f64 / count as f64);
                    schedule.push(Reverse((started + offset, index)));
                }
            }
        }
        Ok(Round {
            pacing,
            measured_from,
            deadline: measured_from + duration,
            schedule,
            outcome: PingOutcome::default(),
            round_trips_ns: Vec::new(),
        })
    }

    /// Sends the pings due by `now` (fixed rate: a connection still waiting for its
    /// reply sends as soon as it comes); returns when the next falls due, or the end.
    fn send_due(
        &mut self,
        connections: &mut [Connection],
        registry: &Registry,
        now: Instant,
    ) -> io::Result<Instant> {
        while let Some(&Reverse((due, index))) = self.schedule.peek() {
            if due > now {
                break;
            }
            self.schedule.pop();
            if let Pacing::Every(interval) = self.pacing {
                self.schedule.push(Reverse((due + interval, index)));
            }
            let connection = &mut connections[index];
            if connection.sent_at.is_some() {
                connection.overdue = true;
            } else {
                connection.send(registry, now)?;
            }
        }
        Ok(self
            .schedule
            .peek()
            .map_or(self.deadline, |Reverse((due, _))| *due)
            .min(self.deadline))
    }

    /// Records the replies a connection read (those of pings sent after the warm-up and
    /// answered before the end count) and sends its next ping as the pacing says.
    fn answered(
        &mut self,
        connection: &mut Connection,
        answers: &[Answer],
        registry: &Registry,
    ) -> io::Result<()> {
        self.outcome.all_replies += answers.len() as u64;
        for &answer in answers {
            let now = Instant::now();
            let Some(sent) = connection.sent_at.take() else {
                continue; // a reply nobody asked for
            };
            if sent >= self.measured_from && now < self.deadline {
                self.round_trips_ns
                    .push(u64::try_from(now.duration_since(sent).as_nanos()).unwrap_or(u64::MAX));
                self.outcome.replies += 1;
                match answer {
                    Answer::Tracked => {}
                    Answer::Untracked => self.outcome.untracked += 1,
                    Answer::Error => self.outcome.errors += 1,
                }
            }
            match self.pacing {
                Pacing::ClosedLoop => connection.send(registry, now)?,
                Pacing::Every(_) if connection.overdue => {
                    connection.overdue = false;
                    connection.send(registry, now)?;
                }
                Pacing::Every(_) => {}
            }
        }
        Ok(())
    }

    /// The outcome of the measured window (the drain's replies still to add).
    fn finish(self, duration: Duration) -> PingOutcome {
        let mut outcome = self.outcome;
        outcome.elapsed = Instant::now()
            .saturating_duration_since(self.measured_from)
            .min(duration);
        outcome.round_trips = Samples::new(self.round_trips_ns);
        outcome
    }
}
