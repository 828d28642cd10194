//! Arbitrary bytes, in arbitrary chunks, through the status listener's request parsing
//! and routing ([`kvwarden::server::http::feed`], what `HttpConnection::read` calls on
//! every read).
//!
//! Oracles: no panic; the buffered head never exceeds `MAX_REQUEST_BYTES`; a full buffer
//! is always answered (a connection never waits forever holding 8 KiB); the three served
//! routes need `GET` or `HEAD` (which says so) and their exact path; every other answer
//! is 400, 404, 405 or 431,
//! and every response encodes into HTTP that parses back with a matching
//! `Content-Length`.
#![no_main]

use kvwarden::server::http::{MAX_REQUEST_BYTES, Response, Route, feed};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte sets the chunk size (1..=256 bytes per read); the rest arrives.
    let Some((&chunk, stream)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(chunk) + 1;
    let mut input = Vec::new();
    let mut routed = None;
    for piece in stream.chunks(chunk) {
        routed = feed(&mut input, piece);
        assert!(input.len() <= MAX_REQUEST_BYTES);
        if routed.is_some() {
            break;
        }
    }
    if input.len() == MAX_REQUEST_BYTES {
        assert!(routed.is_some(), "a full head buffer was left waiting");
    }
    // Routing is a function of the head alone.
    if let Some(route) = &routed {
        assert_eq!(kvwarden::server::http::route(&input).as_ref(), Some(route));
    }
    let Some(routed) = routed else {
        return;
    };
    match routed.route {
        Route::Status | Route::Metrics | Route::Healthz => {
            // Empty lines before the request line are ignored (RFC 9112 section 2.2).
            let head = String::from_utf8_lossy(&input);
            let head = head.trim_start_matches(['\r', '\n']);
            let method = if routed.head { "HEAD " } else { "GET " };
            assert!(
                head.starts_with(method),
                "served a request that is not {method:?}: {head:?}"
            );
        }
        Route::Other(response) => {
            assert!(
                matches!(response.code, 400 | 404 | 405 | 431),
                "unexpected status {}",
                response.code
            );
            check_encoding(&response);
        }
    }
});

fn check_encoding(response: &Response) {
    let bytes = response.encode(false);
    let mut headers = [httparse::EMPTY_HEADER; 8];
    let mut parsed = httparse::Response::new(&mut headers);
    let Ok(httparse::Status::Complete(head_len)) = parsed.parse(&bytes) else {
        panic!(
            "the response head does not parse: {:?}",
            String::from_utf8_lossy(&bytes)
        );
    };
    assert_eq!(parsed.code, Some(response.code));
    let length = parsed
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
        .and_then(|h| std::str::from_utf8(h.value).ok())
        .and_then(|v| v.parse::<usize>().ok())
        .expect("a Content-Length header");
    assert_eq!(length, bytes.len() - head_len);
    assert_eq!(length, response.body.len());
}
