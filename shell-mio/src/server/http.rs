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

    /// The bytes on the wire.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.code,
            self.reason,
            self.content_type,
            self.body.len()
        )
        .into_bytes();
        out.extend_from_slice(&self.body);
        out
    }
}

/// Parses a request head: None while incomplete.
pub fn route(head: &[u8]) -> Option<Route> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(head) {
        Ok(httparse::Status::Partial) => {
            if head.len() >= MAX_REQUEST_BYTES {
                Some(Route::Other(Response::text(
                    431,
                    "Request Header Fields Too Large",
                    "request head too large\n",
                )))
            } else {
                None
            }
        }
        Err(error) => Some(Route::Other(Response::text(
            400,
            "Bad Request",
            &format!("malformed HTTP request: {error}\n"),
        ))),
        Ok(httparse::Status::Complete(_)) => {
            if request.method != Some("GET") {
                return Some(Route::Other(Response::text(
                    405,
                    "Method Not Allowed",
                    "only GET is served\n",
                )));
            }
            let path = request.path.unwrap_or("/");
            let path = path.split('?').next().unwrap_or(path);
            Some(match path {
                "/status" => Route::Status,
                "/metrics" => Route::Metrics,
                "/healthz" => Route::Healthz,
                _ => Route::Other(Response::text(
                    404,
                    "Not Found",
                    "not found; try /status, /metrics or /healthz\n",
                )),
            })
        }
    }
}

/// Appends `chunk` to the head buffered so far (bytes beyond [`MAX_REQUEST_BYTES`] are
/// dropped) and routes it: `None` while the head is incomplete. Once `input` is full the
/// answer is always `Some` (431 or 400), so a connection never waits on a full buffer.
/// Pure: the fuzzer (`http_request`) drives it with arbitrary bytes in arbitrary chunks.
pub fn feed(input: &mut Vec<u8>, chunk: &[u8]) -> Option<Route> {
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
        }
    }

    /// Reads what is available: Ok(Some(route)) once a head is complete; Err when the
    /// peer is gone.
    pub fn read(&mut self) -> io::Result<Option<Route>> {
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

    /// Queues the response.
    pub fn answer(&mut self, response: &Response) {
        self.output = response.encode();
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

    #[test]
    fn routes_known_paths_and_rejects_the_rest() {
        assert_eq!(route(b"GET /status HTTP/1.1\r\n\r\n"), Some(Route::Status));
        assert_eq!(
            route(b"GET /healthz?x=1 HTTP/1.0\r\n\r\n"),
            Some(Route::Healthz)
        );
        assert_eq!(route(b"GET /status HTTP/1.1\r\n"), None);
        // Found by the http_request fuzzer, which wrongly expected a refusal: empty
        // lines before the request line are ignored (RFC 9112 section 2.2).
        assert_eq!(
            route(b"\n\n\r\nGET /healthz HTTP/1.1\r\n\r\n"),
            Some(Route::Healthz)
        );
        assert!(
            matches!(route(b"POST /status HTTP/1.1\r\n\r\n"), Some(Route::Other(r)) if r.code == 405)
        );
        assert!(
            matches!(route(b"\x00\x01garbage\r\n\r\n"), Some(Route::Other(r)) if r.code == 400)
        );
        assert!(
            matches!(route(&vec![b'a'; MAX_REQUEST_BYTES]), Some(Route::Other(r)) if r.code == 400 || r.code == 431)
        );
    }
}
