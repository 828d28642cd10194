//! The L1 pool: its slot table and, on a restarted server, the adoption of its pool
//! file (row 71).

use super::adopt::AdoptionScan;
use super::l1::SlotTable;

/// L1 and its adoption.
pub(super) struct L1Pool {
    pub(super) slots: SlotTable,
    /// A restarted server's adoption of its pool file (row 71).
    pub(super) adoption: Option<AdoptionScan>,
}
