//! A tenant's keys are its own: every key a peer names is prefixed with its tenant's
//! name, in L1 and in L2.

use super::MAX_TENANT_NAME_BYTES;
use crate::protocol::Op;

/// The node's key for a worker's `key` in the keyspace of the tenant named `tenant`:
/// `len(name) | name | key` (tenant names are at most 64 bytes). What L1 and L2 hold;
/// tools that look into L2 (the benchmarks, the tests) name keys with it.
pub fn scoped_key(tenant: &str, key: &[u8]) -> Vec<u8> {
    let name = &tenant.as_bytes()[..tenant.len().min(MAX_TENANT_NAME_BYTES)];
    let mut scoped = Vec::with_capacity(1 + name.len() + key.len());
    scoped.push(name.len() as u8);
    scoped.extend_from_slice(name);
    scoped.extend_from_slice(key);
    scoped
}

/// Puts every key `op` names into the tenant's keyspace (`prefix ++ key`): the one
/// place a request's keys become the node's.
pub fn scope_keys(op: &mut Op, prefix: &[u8]) {
    let scope = |key: &mut Vec<u8>| {
        key.splice(0..0, prefix.iter().copied());
    };
    match op {
        Op::Store { key, .. }
        | Op::Retrieve { key, .. }
        | Op::PrepareStore { key, .. }
        | Op::CommitStore { key, .. }
        | Op::PrepareRetrieve { key, .. }
        | Op::CommitRetrieve { key, .. } => scope(key),
        Op::StoreBatch { items, .. } => items.iter_mut().for_each(|item| scope(&mut item.key)),
        Op::RetrieveBatch { items, .. } => items.iter_mut().for_each(|item| scope(&mut item.key)),
        Op::Lookup { keys } => keys.iter_mut().for_each(scope),
        Op::DescribeKeys { items } => items.iter_mut().for_each(|(key, _)| scope(key)),
        Op::Hello { .. }
        | Op::Auth { .. }
        | Op::Attach { .. }
        | Op::Ping { .. }
        | Op::RegisterKvCache { .. }
        | Op::UnregisterKvCache { .. }
        | Op::RegisterEngineDriven { .. }
        | Op::UnregisterEngineDriven { .. }
        | Op::RegisterBlend { .. }
        | Op::Status
        | Op::KvEvents { .. } => {}
    }
}
