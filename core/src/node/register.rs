//! Registration: REGISTER of either module (`register_kv_cache`,
//! `register_engine_driven`), its refresh while the entry is building or built, the
//! reply that holds, UNREGISTER, and `register_blend`. The liveness registry decides
//! whether a REGISTER builds, refreshes or is refused; this file asks the doors (the
//! mapped bytes' caps) and the registry's builds, and hands the build to the pool.

use super::ops::{Immediate, bad_args};
use crate::liveness::Registration;
use crate::node::{
    BlendId, ContextId, EntryDetails, Job, MAX_BUFFERS_PER_REGISTRATION, Node, Note, PlantedBug,
    ReplyTo, TenantId, Transport, blend,
};
use crate::protocol::{
    Answer, BufferSpec, ErrorCode, Outcome, PoolGeometry, ProtocolError, Registered, RopeSpec,
};
use crate::time::Instant;
use crate::{InstanceId, Module};
use std::collections::BTreeMap;

impl Node {
    pub(super) fn register_engine_driven(
        &mut self,
        now: Instant,
        to: ReplyTo,
        transport: Transport,
        tenant: Option<TenantId>,
        instance: InstanceId,
        model_name: String,
    ) -> Immediate {
        if let Some(tenant) = tenant
            && !self.doors.trust.engine_driven_allowed(tenant)
        {
            return Some(Err(ProtocolError::new(
                ErrorCode::Forbidden,
                format!(
                    "register_engine_driven: tenant {:?} may not register engine-driven: such \
                     a worker maps the whole L1 pool read-write, every tenant's slots \
                     included. Use register_kv_cache with store/retrieve, or have the \
                     operator trust its uids (serve --tenant NAME=uid:N,engine-driven)",
                    self.doors.trust.name(tenant),
                ),
            )));
        }
        if transport != Transport::Unix {
            return Some(Err(bad_args(
                "register_engine_driven: the L1 pool's memfd travels only over the Unix socket \
                 (SCM_RIGHTS), and this connection is TCP; connect over the Unix socket, or \
                 use register_kv_cache with store/retrieve over TCP"
                    .into(),
            )));
        }
        self.register(
            now,
            to,
            instance,
            Module::EngineDriven,
            Vec::new(),
            model_name,
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn register_kv_cache(
        &mut self,
        now: Instant,
        to: ReplyTo,
        transport: Transport,
        instance: InstanceId,
        buffers: Vec<BufferSpec>,
        model_name: String,
        fds: usize,
    ) -> Immediate {
        if buffers.len() > MAX_BUFFERS_PER_REGISTRATION {
            return Some(Err(bad_args(format!(
                "register_kv_cache: {} buffers; at most {MAX_BUFFERS_PER_REGISTRATION} per registration",
                buffers.len()
            ))));
        }
        for (index, spec) in buffers.iter().enumerate() {
            if let Err(refused) = self
                .check_buffer_fd(to, transport, fds, index, spec)
                .and_then(|()| self.check_buffer_device(index, spec))
            {
                return Some(Err(refused));
            }
        }
        self.register(now, to, instance, Module::ServerDriven, buffers, model_name)
    }

    /// A buffer that travels as an fd (a memfd, a CUDA VMM export) names one this
    /// frame carried, over a connection that may carry fds.
    fn check_buffer_fd(
        &self,
        to: ReplyTo,
        transport: Transport,
        fds: usize,
        index: usize,
        spec: &BufferSpec,
    ) -> Result<(), ProtocolError> {
        let Some(fd_index) = spec.fd_index() else {
            return Ok(());
        };
        let what = match spec {
            BufferSpec::Memfd { .. } => "a memfd".to_string(),
            _ => format!("a {} buffer, sent as an fd", spec.kind()),
        };
        if transport != Transport::Unix {
            return Err(bad_args(format!(
                "register_kv_cache: buffers[{index}] is {what}, but fds travel \
                 only over the Unix socket (SCM_RIGHTS); this connection is TCP"
            )));
        }
        // The promise holds whether or not the kernel could enforce it.
        if self.conns.get(&to.conn).is_some_and(|c| !c.sends_fds) {
            return Err(bad_args(format!(
                "register_kv_cache: buffers[{index}] is {what}, but this connection \
                 said `sends_fds: false` in `hello`, so the server takes no fd on it \
                 (the kernel refuses them); register over a connection that sends fds"
            )));
        }
        if usize::try_from(fd_index).map_or(true, |i| i >= fds) {
            return Err(bad_args(format!(
                "register_kv_cache: buffers[{index}].fd_index {fd_index} names an fd \
                 this frame did not carry (it carried {fds}); send the buffers' fds as \
                 SCM_RIGHTS with the frame's first byte"
            )));
        }
        Ok(())
    }

    /// A buffer on a CUDA device names one this server has.
    fn check_buffer_device(&self, index: usize, spec: &BufferSpec) -> Result<(), ProtocolError> {
        let Some(device) = spec.cuda_device() else {
            return Ok(());
        };
        match &self.config.cuda_devices {
            Err(reason) => Err(ProtocolError::new(
                ErrorCode::Unavailable,
                format!(
                    "register_kv_cache: buffers[{index}] is a {} buffer on device {device}, \
                     but this server cannot use CUDA: {reason}; register memfd buffers \
                     instead, or run the server on the GPU host",
                    spec.kind()
                ),
            )),
            Ok(count) if device >= *count => Err(bad_args(format!(
                "register_kv_cache: buffers[{index}].device {device}, but this host \
                 has {count} CUDA device(s) (0..{count})"
            ))),
            Ok(_) => Ok(()),
        }
    }

    /// REGISTER of either module, arguments checked.
    fn register(
        &mut self,
        now: Instant,
        to: ReplyTo,
        instance: InstanceId,
        module: Module,
        buffers: Vec<BufferSpec>,
        model_name: String,
    ) -> Immediate {
        let owner_uid = self.conns.get(&to.conn)?.uid;
        if !self.conns.has_room(to.conn, 1) {
            return Some(Err(self.conns.overloaded(to.conn)));
        }
        let tenant = self.conns.tenant(to.conn);
        self.watch(to.conn, instance);
        match self.liveness.register(now, instance, module) {
            Registration::Refreshed => {
                self.answer_refresh(to, instance, module);
                None
            }
            Registration::Build(ticket) => {
                let context = ContextId(self.out.next_id());
                let bytes = mapped_bytes(&buffers);
                if let Err(over) = self.doors.mapped.charge(context, tenant, bytes) {
                    // Nothing was built: the entry goes as after a failed build.
                    self.liveness.context_build_failed(now, ticket);
                    self.drain_effects();
                    self.forget_if_gone(instance);
                    self.note(Note::OverMappedCap { instance, over });
                    let code = if over.may_fit_later() {
                        ErrorCode::Overloaded
                    } else {
                        ErrorCode::BadArgs
                    };
                    return Some(Err(ProtocolError::new(
                        code,
                        format!("{}: {over}", to.op.name()),
                    )));
                }
                self.registry.records.insert(
                    (instance, module),
                    EntryDetails {
                        owner_uid,
                        tenant,
                        registered_at: now,
                        model_name: model_name.clone(),
                    },
                );
                self.registry.builds.start(context, ticket, to);
                self.conns.start_job(to.conn, 1);
                self.submit_now(Job::Build {
                    context,
                    conn: to.conn,
                    request_id: to.request_id,
                    instance,
                    module,
                    buffers,
                    model_name,
                });
                None
            }
        }
    }

    /// A REGISTER that refreshed a present entry: answered now when the entry is
    /// built, else with the outcome of the build it found running (it may yet fail).
    fn answer_refresh(&mut self, to: ReplyTo, instance: InstanceId, module: Module) {
        let building = self
            .liveness
            .entry(instance, module)
            .is_some_and(|entry| entry.building);
        if building
            && !self.planted(PlantedBug::RefreshBeforeBuild)
            && self.registry.builds.join(instance, module, to)
        {
            return;
        }
        self.reply_registered(to, module, Outcome::Refreshed);
    }

    /// The reply to a REGISTER that holds: `{outcome}` (engine-driven: with the pool's
    /// geometry and memfd).
    pub(super) fn reply_registered(&mut self, to: ReplyTo, module: Module, outcome: Outcome) {
        let pool = (module == Module::EngineDriven).then(|| PoolGeometry {
            slot_bytes: self.l1.slots.slot_bytes(),
            num_slots: self.l1.slots.num_slots() as u64,
        });
        let answer = Answer::Registered(Registered { outcome, pool });
        self.reply_with(to, Ok(answer), pool.is_some());
    }

    pub(super) fn unregister(
        &mut self,
        now: Instant,
        instance: InstanceId,
        module: Module,
    ) -> bool {
        let was = self.liveness.unregister(now, instance, module);
        if !was {
            self.note(Note::UnregisterUnknown { instance, module });
        }
        was
    }

    pub(super) fn register_blend(
        &mut self,
        to: ReplyTo,
        instance: InstanceId,
        rope: RopeSpec,
    ) -> Immediate {
        let bytes = match blend::table_bytes(&rope) {
            Ok(bytes) => bytes,
            Err(message) => return Some(Err(bad_args(format!("`register_blend`: {message}")))),
        };
        let registered = Module::ALL
            .iter()
            .any(|&module| self.liveness.entry(instance, module).is_some());
        if !registered {
            return Some(Err(ProtocolError::new(
                ErrorCode::NotRegistered,
                format!(
                    "`register_blend`: instance {instance} is not registered here, so there is \
                     nothing to attach rope state to; register it (register_kv_cache or \
                     register_engine_driven) first, then retry"
                ),
            )));
        }
        if self.blend.holds(instance, &rope) {
            return Some(Ok(Answer::Flag(true)));
        }
        // One tenant's instances together stay within their share (failure mode 47).
        let tenant_of = |records: &BTreeMap<(InstanceId, Module), EntryDetails>, id: InstanceId| {
            Module::ALL
                .iter()
                .find_map(|&module| records.get(&(id, module)).map(|record| record.tenant))
        };
        let records = &self.registry.records;
        let of_instance = tenant_of(records, instance);
        let holds = |other| tenant_of(records, other) == of_instance;
        let tenant = of_instance.map(|tenant| blend::BlendTenant {
            name: self.doors.trust.name(tenant),
            holds: &holds,
        });
        if let Err(error) = self.blend.admit(instance, bytes, tenant) {
            return Some(Err(error));
        }
        if !self.conns.has_room(to.conn, 1) {
            return Some(Err(self.conns.overloaded(to.conn)));
        }
        let id = BlendId(self.out.next_id());
        self.blend.begin(id, to, instance, rope.clone(), bytes);
        self.conns.start_job(to.conn, 1);
        self.submit_now(Job::Blend {
            blend: id,
            instance,
            spec: rope,
        });
        None
    }
}

/// Bytes of peers' files a registration makes the server map: its memfd buffers' sizes
/// (a CUDA buffer maps device memory its exporter pays for).
fn mapped_bytes(buffers: &[BufferSpec]) -> u64 {
    buffers
        .iter()
        .map(|spec| match spec {
            BufferSpec::Memfd { nbytes, .. } => *nbytes,
            BufferSpec::CudaIpc { .. } | BufferSpec::CudaVmm { .. } => 0,
        })
        .fold(0, u64::saturating_add)
}
