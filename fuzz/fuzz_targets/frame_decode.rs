//! Arbitrary bytes through framing and request decoding, as a connection reads them.
//!
//! The first two bytes choose `--max-frame-bytes` (64 B to 64 KiB); the rest is the byte
//! stream. Frames are split off it with [`split_frame`] and each body goes through
//! [`decode_request`], exactly as `server::connection` and the event loop do; a framing
//! error or `bad_frame` ends the stream (the server closes the connection).
//!
//! Oracles: no panic; the splitter never hands out a body that the limit forbids (nor an
//! empty one), and refuses exactly the headers the spec says (`N = 0` → `bad_frame`,
//! `N > limit` → `too_large`); every decode error carries a spec error code — `bad_frame`
//! without a request id, `bad_args` / `unknown_op` with the id that was read — and its
//! reply encodes and decodes back; decoding allocates at most a constant multiple of the
//! body (a counting allocator measures the peak); a valid request re-encodes to bytes
//! that decode to the same request (compared as canonical bytes, so a NaN rope base
//! compares equal to itself).
#![no_main]

use kvwarden_core::protocol::{
    ErrorCode, LENGTH_PREFIX_BYTES, decode_reply, decode_request, encode_reply, split_frame,
};
use libfuzzer_sys::fuzz_target;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Counts live heap bytes and their peak since the last reset.
struct CountingAllocator;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);
static PEAK_BYTES: AtomicUsize = AtomicUsize::new(0);

fn note_alloc(size: usize) {
    let live = LIVE_BYTES.fetch_add(size, Ordering::Relaxed) + size;
    PEAK_BYTES.fetch_max(live, Ordering::Relaxed);
}

// SAFETY: every call forwards to `System` unchanged; only counters are added.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_alloc(layout.size());
        // SAFETY: forwarded as is.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_alloc(layout.size());
        // SAFETY: forwarded as is.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size >= layout.size() {
            note_alloc(new_size - layout.size());
        } else {
            LIVE_BYTES.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
        }
        // SAFETY: forwarded as is.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Heap a decode may use beyond the body: `Value` trees cost a few dozen bytes per
/// input byte (a one-byte fixint becomes a 32-byte `Value` in a doubling `Vec`), plus
/// a constant for error messages and rmpv's 64 KiB `bin` preallocation.
const ALLOC_PER_BODY_BYTE: usize = 128;
const ALLOC_CONSTANT_BYTES: usize = 256 * 1024;

fuzz_target!(|data: &[u8]| {
    let Some((limit, stream)) = data.split_first_chunk::<2>() else {
        return;
    };
    let max_frame_bytes = 64 + usize::from(u16::from_be_bytes(*limit));
    let mut rest = stream;
    // A connection handles frames until the stream ends, is incomplete, or breaks.
    loop {
        match split_frame(rest, max_frame_bytes) {
            Ok(None) => {
                if let Some(prefix) = rest.first_chunk::<LENGTH_PREFIX_BYTES>() {
                    let n = u32::from_be_bytes(*prefix) as usize;
                    assert!(
                        n > 0 && n <= max_frame_bytes,
                        "waiting on a forbidden header {n}"
                    );
                    assert!(
                        rest.len() < LENGTH_PREFIX_BYTES + n,
                        "a complete frame was not split"
                    );
                }
                return;
            }
            Ok(Some((body, consumed))) => {
                assert!(!body.is_empty(), "an empty body was accepted");
                assert!(
                    body.len() <= max_frame_bytes,
                    "a body above the limit was accepted"
                );
                assert_eq!(consumed, LENGTH_PREFIX_BYTES + body.len());
                rest = &rest[consumed..];
                if !check_body(body) {
                    return; // bad_frame: the server closes the connection
                }
            }
            Err(error) => {
                let n = u32::from_be_bytes(*rest.first_chunk::<4>().expect("a header was read"));
                let code = match error {
                    kvwarden_core::protocol::FrameError::Empty => ErrorCode::BadFrame,
                    kvwarden_core::protocol::FrameError::TooLarge { .. } => ErrorCode::TooLarge,
                };
                assert_eq!(code == ErrorCode::BadFrame, n == 0, "{error}");
                assert_eq!(
                    code == ErrorCode::TooLarge,
                    n as usize > max_frame_bytes,
                    "{error}"
                );
                assert!(code.closes_connection());
                return;
            }
        }
    }
});

/// Decodes one body as the server does; false when the connection would close.
fn check_body(body: &[u8]) -> bool {
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    PEAK_BYTES.store(before, Ordering::Relaxed);
    let decoded = decode_request(body);
    let used = PEAK_BYTES.load(Ordering::Relaxed).saturating_sub(before);
    let bound = ALLOC_PER_BODY_BYTE * body.len() + ALLOC_CONSTANT_BYTES;
    assert!(
        used <= bound,
        "decoding {} bytes allocated {used} bytes (bound {bound})",
        body.len()
    );
    // The client side never panics on the same bytes either.
    let _ = decode_reply(body);
    match decoded {
        Err(error) => {
            let code = error.error.code;
            assert!(
                matches!(
                    code,
                    ErrorCode::BadFrame | ErrorCode::BadArgs | ErrorCode::UnknownOp
                ),
                "decoding produced {code}, which only the server's state can justify"
            );
            assert_eq!(
                code == ErrorCode::BadFrame,
                error.request_id.is_none(),
                "{error}"
            );
            assert!(!error.error.message.is_empty());
            let reply = encode_reply(error.request_id.unwrap_or(0), &Err(error.error.clone()));
            let back = decode_reply(&reply[LENGTH_PREFIX_BYTES..]).expect("an error reply decodes");
            assert_eq!(back.id, error.request_id.unwrap_or(0));
            assert_eq!(back.result, Err(error.error.clone()));
            code != ErrorCode::BadFrame
        }
        Ok(request) => {
            // The one request encoder (`Request::encode`) that clients and benches use.
            let once = request.encode();
            let again = decode_request(&once[LENGTH_PREFIX_BYTES..])
                .unwrap_or_else(|e| panic!("a re-encoded {request:?} does not decode: {e}"));
            assert_eq!(again.encode(), once, "round trip changed {request:?}");
            true
        }
    }
}
