//! A scenario's `[[events]]`: the faults, each with what undoes it (`until_seconds`).

use super::{RawEvent, Reader, ScenarioError};
use crate::config::{Action, CutDirection, FaultEvent, TokenChoice, WorkerSpec};

/// An action, and the action that undoes it where one does.
type Fault = (Action, Option<Action>);

impl Reader<'_> {
    pub(super) fn event(
        &self,
        index: usize,
        raw: &RawEvent,
        workers: &[WorkerSpec],
        events: &mut Vec<FaultEvent>,
    ) -> Result<(), ScenarioError> {
        let field = |name: &str| format!("events[{index}].{name}");
        let at = self.seconds(&field("at_seconds"), raw.at_seconds)?;
        let found = match self.worker_fault(index, raw, workers)? {
            Some(fault) => Some(fault),
            None => match self.server_fault(index, raw)? {
                Some(fault) => Some(fault),
                None => match self.adversary_fault(index, raw, workers)? {
                    Some(fault) => Some(fault),
                    None => self.l2_fault(index, raw, workers)?,
                },
            },
        };
        let (action, undo) = match (found, raw.action.as_str()) {
            (Some(fault), _) => fault,
            (None, "heal_all") => (Action::HealAll, None),
            (None, other) => {
                return Err(self.bad(
                    field("action"),
                    format!("{other:?}"),
                    "one of crash, restart, freeze, thaw, starve_heartbeat, feed_heartbeat, stop, unregister, register, transfer, partition, heal, set_link, server_pause, server_resume, server_restart, server_stop, clock_step, build_failure_rate, free_hang_rate, intrude, impersonate, poach, tcp_probe, l2_down, l2_partition, l2_up, l2_slow, l2_corrupt, l2_flaky, l2_garble, heal_all",
                ));
            }
        };
        events.push(FaultEvent { at, action });
        if let Some(until) = raw.until_seconds {
            let Some(undo) = undo else {
                return Err(self.bad(field("until_seconds"), until, "only freeze, starve_heartbeat, partition, server_pause, l2_down, l2_partition, l2_slow, l2_corrupt and l2_flaky can be undone with until_seconds"));
            };
            let end = self.seconds(&field("until_seconds"), until)?;
            if end < at {
                return Err(self.bad(field("until_seconds"), until, "not before at_seconds"));
            }
            events.push(FaultEvent {
                at: end,
                action: undo,
            });
        }
        Ok(())
    }

    /// A fault of workers' processes, heartbeats and links; None for another action.
    fn worker_fault(
        &self,
        index: usize,
        raw: &RawEvent,
        workers: &[WorkerSpec],
    ) -> Result<Option<Fault>, ScenarioError> {
        let field = |name: &str| format!("events[{index}].{name}");
        let slots = || self.slots(&field("workers"), &raw.workers, workers);
        Ok(Some(match raw.action.as_str() {
            "crash" => (Action::Crash(slots()?), None),
            "restart" => (Action::Restart(slots()?), None),
            "freeze" => (Action::Freeze(slots()?), Some(Action::Thaw(slots()?))),
            "thaw" => (Action::Thaw(slots()?), None),
            "starve_heartbeat" => (
                Action::StarveHeartbeat(slots()?),
                Some(Action::FeedHeartbeat(slots()?)),
            ),
            "feed_heartbeat" => (Action::FeedHeartbeat(slots()?), None),
            "stop" => (Action::Stop(slots()?), None),
            "unregister" => (Action::Unregister(slots()?), None),
            "register" => (Action::Register(slots()?), None),
            "transfer" => (Action::Transfer(slots()?), None),
            "partition" => {
                let direction = match raw.direction.as_deref().unwrap_or("both") {
                    "both" => CutDirection::Both,
                    "to_server" => CutDirection::ToServer,
                    "to_worker" => CutDirection::ToWorker,
                    other => {
                        return Err(self.bad(
                            field("direction"),
                            format!("{other:?}"),
                            "\"both\", \"to_server\" or \"to_worker\"",
                        ));
                    }
                };
                (
                    Action::Partition(slots()?, direction),
                    Some(Action::Heal(slots()?)),
                )
            }
            "heal" => (Action::Heal(slots()?), None),
            "set_link" => {
                let Some(link) = &raw.link else {
                    return Err(self.bad(
                        field("link"),
                        "nothing",
                        "set_link needs link = { delay_ms, jitter_ms, loss, duplicate }",
                    ));
                };
                (
                    Action::SetLink(slots()?, self.link(&field("link"), link)?),
                    None,
                )
            }
            _ => return Ok(None),
        }))
    }

    /// A fault of the server or the clock; None for another action.
    fn server_fault(&self, index: usize, raw: &RawEvent) -> Result<Option<Fault>, ScenarioError> {
        let field = |name: &str| format!("events[{index}].{name}");
        Ok(Some(match raw.action.as_str() {
            "server_pause" => (Action::ServerPause, Some(Action::ServerResume)),
            "server_resume" => (Action::ServerResume, None),
            "server_restart" => {
                let down = self.seconds(&field("down_seconds"), raw.down_seconds.unwrap_or(0.0))?;
                (Action::ServerRestart { down }, None)
            }
            "server_stop" => (Action::ServerStop, None),
            "clock_step" => {
                let Some(step) = raw.step_seconds.filter(|s| s.is_finite()) else {
                    return Err(self.bad(
                        field("step_seconds"),
                        format!("{:?}", raw.step_seconds),
                        "clock_step needs a finite step_seconds (negative: backwards)",
                    ));
                };
                (Action::ClockStep((step * 1e9) as i64), None)
            }
            "build_failure_rate" => {
                let rate = self.probability(&field("rate"), raw.rate.unwrap_or(-1.0))?;
                (Action::BuildFailureRate(rate), None)
            }
            "free_hang_rate" => {
                let rate = self.probability(&field("rate"), raw.rate.unwrap_or(-1.0))?;
                (Action::FreeHangRate(rate), None)
            }
            _ => return Ok(None),
        }))
    }

    /// A neighbour's attack; None for another action.
    fn adversary_fault(
        &self,
        index: usize,
        raw: &RawEvent,
        workers: &[WorkerSpec],
    ) -> Result<Option<Fault>, ScenarioError> {
        let field = |name: &str| format!("events[{index}].{name}");
        let slots = || self.slots(&field("workers"), &raw.workers, workers);
        Ok(Some(match raw.action.as_str() {
            "intrude" => {
                let from = slots()?;
                let target = raw
                    .target
                    .as_ref()
                    .map(|t| vec![t.clone()])
                    .unwrap_or_default();
                let target = self.slots(&field("target"), &target, workers)?;
                if from.len() != 1 || target.len() != 1 || from[0] == target[0] {
                    return Err(self.bad(
                        field("target"),
                        format!("{:?}", raw.target),
                        "intrude needs one worker in workers and another one in target",
                    ));
                }
                (Action::Intrude(from[0], target[0]), None)
            }
            "impersonate" | "poach" => {
                let from = slots()?;
                if from.len() != 1 {
                    return Err(self.bad(
                        field("workers"),
                        format!("{:?}", raw.workers),
                        "impersonate and poach need exactly one worker (the adversary)",
                    ));
                }
                if raw.action == "poach" {
                    (Action::Poach(from[0]), None)
                } else {
                    (Action::Impersonate(from[0]), None)
                }
            }
            "tcp_probe" => {
                let token = match raw.token.as_deref().unwrap_or("missing") {
                    "missing" => TokenChoice::Missing,
                    "wrong" => TokenChoice::Wrong,
                    "right" => TokenChoice::Right,
                    other => {
                        return Err(self.bad(
                            field("token"),
                            format!("{other:?}"),
                            "\"missing\", \"wrong\" or \"right\" (the server's tcp_token)",
                        ));
                    }
                };
                (Action::TcpProbe(token), None)
            }
            _ => return Ok(None),
        }))
    }

    /// A fault of L2; None for another action.
    fn l2_fault(
        &self,
        index: usize,
        raw: &RawEvent,
        workers: &[WorkerSpec],
    ) -> Result<Option<Fault>, ScenarioError> {
        let field = |name: &str| format!("events[{index}].{name}");
        let slots = || self.slots(&field("workers"), &raw.workers, workers);
        Ok(Some(match raw.action.as_str() {
            "l2_down" => (Action::L2Down, Some(Action::L2Up)),
            "l2_partition" => (Action::L2Partition, Some(Action::L2Up)),
            "l2_up" => (Action::L2Up, None),
            "l2_slow" => {
                let Some(delay) = raw.delay_ms else {
                    return Err(self.bad(
                        field("delay_ms"),
                        "nothing",
                        "l2_slow needs delay_ms (how late L2 answers; above l2.timeout_ms to be slow)",
                    ));
                };
                (
                    Action::L2Slow(self.millis(&field("delay_ms"), delay)?),
                    Some(Action::L2Up),
                )
            }
            "l2_corrupt" => {
                let rate = self.probability(&field("rate"), raw.rate.unwrap_or(-1.0))?;
                (Action::L2Corrupt(rate), Some(Action::L2Corrupt(0.0)))
            }
            "l2_garble" => (Action::L2Garble(slots()?), None),
            "l2_flaky" => {
                let rate = self.probability(&field("rate"), raw.rate.unwrap_or(-1.0))?;
                (Action::L2Flaky(rate), Some(Action::L2Flaky(0.0)))
            }
            _ => return Ok(None),
        }))
    }
}
