//! A test harness that drives `Liveness` like a shell would: virtual time jumps straight
//! to the core's next deadline, effects are drained after every input. The node tests'
//! shell is in [`harness`].

#![allow(dead_code)]

pub mod harness;

use kvwarden_core::{
    BuildTicket, Config, Effect, FreeCause, InstanceId, Instant, Liveness, Module, Registration,
};
use std::time::Duration;

pub const SD: Module = Module::ServerDriven;
pub const ED: Module = Module::EngineDriven;

pub fn at(seconds: f64) -> Instant {
    Instant::ZERO + Duration::from_secs_f64(seconds)
}

pub fn secs(seconds: f64) -> Duration {
    Duration::from_secs_f64(seconds)
}

pub fn id(raw: u64) -> InstanceId {
    InstanceId::new(raw).unwrap()
}

/// A context is a number; each build hands out the next one.
pub type Ctx = u32;

pub struct Shell {
    pub liveness: Liveness<Ctx>,
    pub now: Instant,
    pub effects: Vec<(Instant, Effect<Ctx>)>,
    next_context: Ctx,
}

impl Shell {
    pub fn new(config: Config) -> Shell {
        Shell {
            liveness: Liveness::new(config, Instant::ZERO).expect("valid config"),
            now: Instant::ZERO,
            effects: Vec::new(),
            next_context: 1,
        }
    }

    pub fn with_defaults() -> Shell {
        Shell::new(Config::default())
    }

    /// Runs the loop until `t`: every wake the core asks for is honoured, then the
    /// clock stands at `t`.
    pub fn run_until(&mut self, t: Instant) {
        while let Some(wake) = self.liveness.poll_timeout() {
            if wake > t {
                break;
            }
            assert!(
                wake >= self.now,
                "the core asked to wake in the past: {wake:?} < {:?}",
                self.now
            );
            self.now = wake;
            self.liveness.handle_timeout(wake);
            self.drain();
        }
        self.now = t;
        self.liveness.handle_timeout(t);
        self.drain();
    }

    pub fn drain(&mut self) {
        while let Some(effect) = self.liveness.poll_effect() {
            self.effects.push((self.now, effect));
        }
    }

    /// REGISTER and build the context at once; returns the context.
    pub fn register_built(&mut self, instance: InstanceId, module: Module) -> Ctx {
        let ticket = self.register_building(instance, module);
        self.build(ticket)
    }

    pub fn register_building(&mut self, instance: InstanceId, module: Module) -> BuildTicket {
        match self.liveness.register(self.now, instance, module) {
            Registration::Build(ticket) => ticket,
            Registration::Refreshed => panic!("{instance:?}/{module:?} was already present"),
        }
    }

    pub fn build(&mut self, ticket: BuildTicket) -> Ctx {
        let context = self.next_context;
        self.next_context += 1;
        self.liveness.context_built(self.now, ticket, context);
        self.drain();
        context
    }

    pub fn ping(&mut self, instance: InstanceId) -> bool {
        let tracked = self.liveness.ping(self.now, Some(instance));
        self.drain();
        tracked
    }

    /// Every FreeContext so far, as (when, instance, module, context, cause).
    pub fn frees(&self) -> Vec<(Instant, InstanceId, Module, Ctx, FreeCause)> {
        self.effects
            .iter()
            .filter_map(|(when, effect)| match effect {
                Effect::FreeContext {
                    instance,
                    module,
                    context,
                    cause,
                } => Some((*when, *instance, *module, *context, *cause)),
                _ => None,
            })
            .collect()
    }

    pub fn blend_drops(&self, instance: InstanceId) -> Vec<Instant> {
        self.effects
            .iter()
            .filter_map(|(when, effect)| match effect {
                Effect::DropBlendState { instance: dropped } if *dropped == instance => Some(*when),
                _ => None,
            })
            .collect()
    }

    pub fn stalls(&self) -> Vec<Duration> {
        self.effects
            .iter()
            .filter_map(|(_, effect)| match effect {
                Effect::StallDetected { gap } => Some(*gap),
                _ => None,
            })
            .collect()
    }

    pub fn tracked(&self, instance: InstanceId, module: Module) -> bool {
        self.liveness.entry(instance, module).is_some()
    }
}
