//! Host memory that registrations make the server map: each server-driven context's
//! memfd bytes, by instance, by tenant and in total, under the operator's caps
//! (`--max-mapped-bytes`, `--max-mapped-bytes-per-tenant`,
//! `--max-mapped-bytes-per-instance`; failure mode 57).
//!
//! A peer's memfd may be sparse: it costs its sender nothing, yet every byte the server
//! maps is address space the server gives up, and every page a retrieve writes into a
//! hole is a page the kernel charges to the server. The caps bound both: the server
//! never maps, and so never pays for, more than `total_bytes` of its peers' files, one
//! tenant never more than `per_tenant_bytes` of it, and one instance never more than
//! `per_instance_bytes`. A CUDA IPC buffer maps device memory its exporter pays for and
//! is not counted.

use super::ContextId;
use super::trust::TenantId;
use std::collections::HashMap;
use thiserror::Error;

/// The caps on mapped bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappedLimits {
    /// Every registration together.
    pub total_bytes: u64,
    /// One tenant's registrations together (a uid's, or an operator's tenant's).
    pub per_tenant_bytes: u64,
    /// One registration.
    pub per_instance_bytes: u64,
}

impl MappedLimits {
    /// `total_bytes` in all; `per_tenant_bytes` (None: three quarters of the total, so
    /// that a quarter always stays for the other tenants) and `per_instance_bytes`
    /// (None: the tenant's cap) are lowered to what holds them.
    pub fn new(
        total_bytes: u64,
        per_tenant_bytes: Option<u64>,
        per_instance_bytes: Option<u64>,
    ) -> MappedLimits {
        let per_tenant_bytes = per_tenant_bytes
            .unwrap_or(total_bytes - total_bytes / 4)
            .min(total_bytes);
        let per_instance_bytes = per_instance_bytes
            .unwrap_or(per_tenant_bytes)
            .min(per_tenant_bytes);
        MappedLimits {
            total_bytes,
            per_tenant_bytes,
            per_instance_bytes,
        }
    }

    /// No cap that a test or a simulation would reach.
    pub fn unbounded() -> MappedLimits {
        MappedLimits {
            total_bytes: u64::MAX,
            per_tenant_bytes: u64::MAX,
            per_instance_bytes: u64::MAX,
        }
    }
}

/// Why a registration's buffers were refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum OverCap {
    /// One registration asks for more than an instance may map.
    #[error(
        "its memfd buffers total {bytes} bytes, over the {cap} bytes one instance may \
         register (serve --max-mapped-bytes-per-instance); register smaller buffers, or \
         ask the operator to raise the cap"
    )]
    Instance {
        /// The registration's bytes.
        bytes: u64,
        /// The cap.
        cap: u64,
    },
    /// The tenant's registrations would pass its share.
    #[error(
        "its memfd buffers ({bytes} bytes) and the {held} bytes its tenant has registered \
         already pass the tenant's {cap} bytes (serve --max-mapped-bytes-per-tenant); \
         unregister instances this tenant no longer uses, or ask the operator to raise the cap"
    )]
    Tenant {
        /// The registration's bytes.
        bytes: u64,
        /// What the tenant holds already.
        held: u64,
        /// The cap.
        cap: u64,
    },
    /// Every registration together would pass the total.
    #[error(
        "its memfd buffers ({bytes} bytes) and the {held} bytes registered on this server \
         already pass its {cap} bytes (serve --max-mapped-bytes); try again once others \
         unregister, or ask the operator to raise the cap"
    )]
    Total {
        /// The registration's bytes.
        bytes: u64,
        /// What all registrations hold already.
        held: u64,
        /// The cap.
        cap: u64,
    },
}

impl OverCap {
    /// Whether waiting can help: a registration over the instance cap never fits.
    pub fn may_fit_later(self) -> bool {
        !matches!(self, OverCap::Instance { .. })
    }

    /// Its name in logs and metrics.
    pub fn label(self) -> &'static str {
        match self {
            OverCap::Instance { .. } => "instance",
            OverCap::Tenant { .. } => "tenant",
            OverCap::Total { .. } => "total",
        }
    }
}

/// The bytes each context maps, and their sums.
#[derive(Debug)]
pub struct Mapped {
    limits: MappedLimits,
    by_context: HashMap<ContextId, (TenantId, u64)>,
    by_tenant: HashMap<TenantId, u64>,
    total: u64,
    refused: u64,
}

impl Mapped {
    /// Nothing mapped yet.
    pub fn new(limits: MappedLimits) -> Mapped {
        Mapped {
            limits,
            by_context: HashMap::new(),
            by_tenant: HashMap::new(),
            total: 0,
            refused: 0,
        }
    }

    /// Counts `bytes` for `context` (of `tenant`) when every cap holds them, else
    /// counts nothing and says which cap they pass.
    pub fn charge(
        &mut self,
        context: ContextId,
        tenant: TenantId,
        bytes: u64,
    ) -> Result<(), OverCap> {
        let held = self.by_tenant.get(&tenant).copied().unwrap_or(0);
        let refusal = if bytes > self.limits.per_instance_bytes {
            Some(OverCap::Instance {
                bytes,
                cap: self.limits.per_instance_bytes,
            })
        } else if held.saturating_add(bytes) > self.limits.per_tenant_bytes {
            Some(OverCap::Tenant {
                bytes,
                held,
                cap: self.limits.per_tenant_bytes,
            })
        } else if self.total.saturating_add(bytes) > self.limits.total_bytes {
            Some(OverCap::Total {
                bytes,
                held: self.total,
                cap: self.limits.total_bytes,
            })
        } else {
            None
        };
        if let Some(refusal) = refusal {
            self.refused += 1;
            return Err(refusal);
        }
        if bytes > 0 {
            self.by_context.insert(context, (tenant, bytes));
            *self.by_tenant.entry(tenant).or_insert(0) += bytes;
            self.total += bytes;
        }
        Ok(())
    }

    /// `context` maps nothing any more (its build failed, or its free started).
    pub fn release(&mut self, context: ContextId) {
        let Some((tenant, bytes)) = self.by_context.remove(&context) else {
            return;
        };
        self.total -= bytes;
        if let Some(held) = self.by_tenant.get_mut(&tenant) {
            *held -= bytes;
            if *held == 0 {
                self.by_tenant.remove(&tenant);
            }
        }
    }

    /// Bytes mapped now, all registrations together.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Bytes `tenant`'s registrations map now.
    pub fn of_tenant(&self, tenant: TenantId) -> u64 {
        self.by_tenant.get(&tenant).copied().unwrap_or(0)
    }

    /// The caps.
    pub fn limits(&self) -> MappedLimits {
        self.limits
    }

    /// Registrations refused for a cap since start.
    pub fn refused(&self) -> u64 {
        self.refused
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_keep_a_quarter_for_other_tenants_and_lower_what_cannot_hold() {
        let limits = MappedLimits::new(1000, None, None);
        assert_eq!(
            (limits.per_tenant_bytes, limits.per_instance_bytes),
            (750, 750)
        );
        let limits = MappedLimits::new(1000, Some(5000), Some(100));
        assert_eq!(
            (limits.per_tenant_bytes, limits.per_instance_bytes),
            (1000, 100)
        );
        let limits = MappedLimits::new(1000, Some(200), Some(300));
        assert_eq!(
            limits.per_instance_bytes, 200,
            "lowered to the tenant's cap"
        );
    }

    /// Each cap refuses what passes it and admits what fits, and a release gives the
    /// bytes back: to the tenant and to the total.
    #[test]
    fn each_cap_refuses_what_passes_it_and_a_release_gives_bytes_back() {
        let mut mapped = Mapped::new(MappedLimits::new(1000, Some(600), Some(400)));
        let (a, b) = (TenantId(1), TenantId(2));
        assert_eq!(
            mapped.charge(ContextId(1), a, 401),
            Err(OverCap::Instance {
                bytes: 401,
                cap: 400
            })
        );
        assert_eq!(mapped.charge(ContextId(1), a, 400), Ok(()));
        assert_eq!(
            mapped.charge(ContextId(2), a, 201),
            Err(OverCap::Tenant {
                bytes: 201,
                held: 400,
                cap: 600
            })
        );
        assert_eq!(mapped.charge(ContextId(2), a, 200), Ok(()));
        assert_eq!(mapped.charge(ContextId(3), b, 400), Ok(()));
        assert_eq!(
            mapped.charge(ContextId(4), b, 1),
            Err(OverCap::Total {
                bytes: 1,
                held: 1000,
                cap: 1000
            })
        );
        assert_eq!((mapped.total(), mapped.of_tenant(a)), (1000, 600));
        assert_eq!(mapped.refused(), 3);
        mapped.release(ContextId(1));
        mapped.release(ContextId(1)); // once only
        assert_eq!((mapped.total(), mapped.of_tenant(a)), (600, 200));
        assert_eq!(mapped.charge(ContextId(4), b, 200), Ok(()));
        assert!(!OverCap::Instance { bytes: 2, cap: 1 }.may_fit_later());
    }
}
