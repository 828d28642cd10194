//! Arbitrary replies, timeouts, recoveries and stops against the worker's heartbeat.
//!
//! Oracles: no panic; no action after stop and health frozen by it; `Recover` only
//! after a reply to an in-flight ping, never twice without `on_recover_done` between;
//! health is set only by a successful recovery; `SendPing` only when due.
#![no_main]

use arbitrary::Arbitrary;
use kvwarden_core::{Heartbeat, HeartbeatAction, HeartbeatConfig, Instant, PingReply};
use libfuzzer_sys::fuzz_target;
use std::time::Duration;

#[derive(Arbitrary, Debug)]
enum Op {
    Start,
    Advance(u32),
    Timeout,
    Reply(u8),
    RecoverDone(bool),
    Stop,
}

fuzz_target!(|input: (u16, Vec<Op>)| {
    let interval = Duration::from_millis(u64::from(input.0) + 1);
    let mut hb = Heartbeat::new(HeartbeatConfig { interval });
    let mut now = Instant::ZERO;
    let mut recovering = false;
    let mut stopped_health: Option<bool> = None;
    for op in input.1.into_iter().take(4000) {
        let was_healthy = hb.is_healthy();
        let action = match op {
            Op::Start => {
                hb.start(now);
                None
            }
            Op::Advance(ns) => {
                now = now + Duration::from_nanos(u64::from(ns));
                None
            }
            Op::Timeout => {
                let due = hb.poll_timeout();
                let action = hb.handle_timeout(now);
                if action == Some(HeartbeatAction::SendPing) {
                    assert!(
                        due.is_some_and(|due| due <= now),
                        "ping sent before it was due"
                    );
                }
                action
            }
            Op::Reply(kind) => {
                let reply = [PingReply::Known, PingReply::Unknown, PingReply::Failed]
                    [usize::from(kind % 3)];
                let action = hb.on_ping_reply(now, reply);
                if reply == PingReply::Failed {
                    assert!(action.is_none());
                }
                action
            }
            Op::RecoverDone(ok) => {
                hb.on_recover_done(now, ok);
                if hb.is_healthy() && !was_healthy {
                    assert!(recovering && ok, "health set without a successful recovery");
                }
                recovering = false;
                None
            }
            Op::Stop => {
                hb.stop();
                stopped_health.get_or_insert(hb.is_healthy());
                None
            }
        };
        if let Some(health) = stopped_health {
            assert!(action.is_none(), "an action after stop");
            assert_eq!(hb.is_healthy(), health, "health changed after stop");
            assert_eq!(hb.poll_timeout(), None);
        }
        if action == Some(HeartbeatAction::Recover) {
            assert!(!recovering, "a second recovery while one runs");
            assert!(!hb.is_healthy(), "healthy while a recovery runs");
            recovering = true;
        }
        if recovering {
            assert_eq!(hb.poll_timeout(), None, "a ping scheduled during recovery");
        }
        if !matches!(op, Op::RecoverDone(_)) && hb.is_healthy() && !was_healthy {
            panic!("health set outside on_recover_done");
        }
    }
});
