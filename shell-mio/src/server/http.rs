//! The HTTP listener (`/status`, `/metrics`, `/healthz`), served from the event loop so
//! that it answers only while the loop turns.

use std::io::{self, Read, Write};

/// The largest request head accepted; more is answered 431 and closed.
pub const MAX_REQUEST_BYTES: usize = 8 * 1024;

/// What the loop answers for a path.
#[derive(Debug, PartialEq, Eq)]
pub enum Route {
    /// `GET /status`.
    Status,
    /// `GET /metrics`.
    Metrics,
    /// `GET /healthz`.
    Healthz,
    /// Anything else: answered directly.
    Other(Response),
}

/// A routed request head: where it goes, and how to answer it.
#[derive(Debug, PartialEq, Eq)]
pub struct Routed {
    /// The path's route.
    pub route: Route,
    /// `HEAD`: the headers of the `GET` answer, no body.
    pub head: bool,
    /// The client asked for OpenMetrics (`Accept: application/openmetrics-text`);
    /// otherwise `/metrics` is the classic Prometheus text format.
    pub openmetrics: bool,
}

impl Routed {
    fn answer(response: Response) -> Routed {
        Routed {
            route: Route::Other(response),
            head: false,
            openmetrics: false,
        }
    }
}

/// A response.
#[derive(Debug, PartialEq, Eq)]
pub struct Response {
    /// Status code.
    pub code: u16,
    /// Reason phrase.
    pub reason: &'static str,
    /// Content type.
    pub content_type: &'static str,
    /// Body.
    pub body: Vec<u8>,
}

impl Response {
    /// A plain-text response.
    pub fn text(code: u16, reason: &'static str, body: &str) -> Response {
        Response {
            code,
            reason,
            content_type: "text/plain; charset=utf-8",
            body: body.as_bytes().to_vec(),
        }
    }

    /// The bytes on the wire; for a `HEAD` (`head`), the headers alone (with the
    /// length the body would have).
    pub fn encode(&self, head: bool) -> Vec<u8> {
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.code,
            self.reason,
            self.content_type,
            self.body.len()
        )
        .into_bytes();
        if !head {
            out.extend_from_slice(&self.body);
        }
        out
    }
}

/// Parses a request head: None while incomplete.
pub fn route(head: &[u8]) -> Option<Routed> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(head) {
        Ok(httparse::Status::Partial) => {
            if head.len() >= MAX_REQUEST_BYTES {
                Some(Routed::answer(Response::text(
                    431,
                    "Request Header Fields Too Large",
                    "request head too large\n",
                )))
            } else {
                None
            }
        }
        Err(error) => Some(Routed::answer(Response::text(
            400,
            "Bad Request",
            &format!("malformed HTTP request: {error}\n"),
        ))),
        Ok(httparse::Status::Complete(_)) => {
            let head = match request.method {
                Some("GET") => false,
                Some("HEAD") => true,
                _ => {
                    return Some(Routed::answer(Response::text(
                        405,
                        "Method Not Allowed",
                        "only GET and HEAD are served\n",
                    )));
                }
            };
            let openmetrics = request.headers.iter().any(|header| {
                header.name.eq_ignore_ascii_case("accept")
                    && std::str::from_utf8(header.value)
                        .is_ok_and(|value| value.contains("application/openmetrics-text"))
            });
            let path = request.path.unwrap_or("/");
            let path = path.split('?').next().unwrap_or(path);
            let route = match path {
                "/status" => Route::Status,
                "/metrics" => Route::Metrics,
                "/healthz" => Route::Healthz,
                _ => Route::Other(Response::text(
                    404,
                    "Not Found",
                    "not found; try /status, /metrics or /healthz\n",
                )),
            };
            Some(Routed {
                route,
                head,
                openmetrics,
            })
        }
    }
}

/// Appends `chunk` to the head buffered so far (bytes beyond [`MAX_REQUEST_BYTES`] are
/// dropped) and routes it: `None` while the head is incomplete. Once `input` is full the
/// answer is always `Some` (431 or 400), so a connection never waits on a full buffer.
/// Pure: the fuzzer (`http_request`) drives it with arbitrary bytes in arbitrary chunks.
pub fn feed(input: &mut Vec<u8>, chunk: &[u8]) -> Option<Routed> {
    let room = MAX_REQUEST_BYTES.saturating_sub(input.len());
    input.extend_from_slice(&chunk[..chunk.len().min(room)]);
    route(input)
}

/// One HTTP connection: read a head, answer once, close.
#[derive(Debug)]
pub struct HttpConnection {
    /// The socket.
    pub stream: mio::net::TcpStream,
    input: Vec<u8>,
    output: Vec<u8>,
    written: usize,
    /// A response was queued.
    pub answered: bool,
    /// When it was accepted: a request must be read and answered within the frame
    /// timeout of this, and a full listener closes the oldest of a kind first
    /// ([`HttpConnection::pending_rank`]).
    pub accepted: std::time::Instant,
}

impl HttpConnection {
    /// A fresh connection.
    pub fn new(stream: mio::net::TcpStream) -> HttpConnection {
        HttpConnection {
            stream,
            input: Vec::new(),
            output: Vec::new(),
            written: 0,
            answered: false,
            accepted: std::time::Instant::now(),
        }
    }

    /// Reads what is available: Ok(Some(route)) once a head is complete; Err when the
    /// peer is gone.
    pub fn read(&mut self) -> io::Result<Option<Routed>> {
        let mut chunk = [0u8; 4096];
        loop {
            if self.answered {
                return Ok(None);
            }
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    if let Some(route) = feed(&mut self.input, &chunk[..n]) {
                        return Ok(Some(route));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Which a full listener closes first (lowest first): 0 sent nothing, 1 answered
    /// but its peer does not read the answer, 2 part of a request pending.
    pub fn pending_rank(&self) -> u8 {
        if self.answered {
            1
        } else if self.input.is_empty() {
            0
        } else {
            2
        }
    }

    /// Queues the response (its headers alone for a `HEAD`).
    pub fn answer(&mut self, response: &Response, head: bool) {
        self.output = response.encode(head);
        self.answered = true;
    }

    /// Writes; Ok(true) when everything was sent.
    pub fn flush(&mut self) -> io::Result<bool> {
        while self.written < self.output.len() {
            match self.stream.write(&self.output[self.written..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(self.answered)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route_of(head: &[u8]) -> Option<Route> {
        route(head).map(|routed| routed.route)
    }

    #[test]
    fn routes_known_paths_and_rejects_the_rest() {
        assert_eq!(
            route_of(b"GET /status HTTP/1.1\r\n\r\n"),
            Some(Route::Status)
        );
        assert_eq!(
            route_of(b"GET /healthz?x=1 HTTP/1.0\r\n\r\n"),
            Some(Route::Healthz)
        );
        assert_eq!(route_of(b"GET /status HTTP/1.1\r\n"), None);
        // Found by the http_request fuzzer, which wrongly expected a refusal: empty
        // lines before the request line are ignored (RFC 9112 section 2.2).
        assert_eq!(
            route_of(b"\n\n\r\nGET /healthz HTTP/1.1\r\n\r\n"),
            Some(Route::Healthz)
        );
        assert!(
            matches!(route_of(b"POST /status HTTP/1.1\r\n\r\n"), Some(Route::Other(r)) if r.code == 405)
        );
        assert!(
            matches!(route_of(b"\x00\x01garbage\r\n\r\n"), Some(Route::Other(r)) if r.code == 400)
        );
        assert!(
            matches!(route_of(&vec![b'a'; MAX_REQUEST_BYTES]), Some(Route::Other(r)) if r.code == 400 || r.code == 431)
        );
    }

    /// `HEAD` is a `GET` without the body (probes and load balancers send it); the
    /// classic text format unless the scraper asks for OpenMetrics.
    #[test]
    fn head_is_served_and_metrics_negotiate_their_format() {
        let head = route(b"HEAD /healthz HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!((head.route, head.head), (Route::Healthz, true));
        let get = route(b"GET /metrics HTTP/1.1\r\nAccept: */*\r\n\r\n").unwrap();
        assert!(!get.head && !get.openmetrics);
        let scraper = route(
            b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\n\r\n",
        )
        .unwrap();
        assert!(scraper.openmetrics);
        let response = Response::text(200, "OK", "ok\n");
        let headers = String::from_utf8(response.encode(true)).unwrap();
        assert!(headers.ends_with("\r\n\r\n"), "{headers}");
        assert!(headers.contains("Content-Length: 3"), "{headers}");
        assert!(response.encode(false).ends_with(b"ok\n"));
    }
}
