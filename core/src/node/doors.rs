//! Who may come in, act, and hold what: who is who ([`Trust`]), connection admission,
//! and the bytes of peers' memfds mapped under their caps.

use super::admission::{self, Admission};
use super::conns::Conn;
use super::mapped::Mapped;
use super::trust::Trust;
use super::{ConnId, Transport};
use crate::protocol::{Answer, ErrorCode, Op, ProtocolError};

/// The node's doors.
pub(super) struct Doors {
    pub(super) trust: Trust,
    pub(super) admission: Admission,
    /// Bytes of peers' memfds mapped, under their caps.
    pub(super) mapped: Mapped,
}

impl Doors {
    /// Whether a peer of `uid` (None: TCP) may open one more connection now; a
    /// subordinate uid counts as its owner (row 69).
    pub(super) fn admits(&self, uid: Option<u32>) -> Result<(), admission::Refused> {
        self.admission
            .admits(uid.map(|uid| self.trust.counted_uid(uid)))
    }

    /// Who is who for one request of `connection` (`conn`): `auth` and `attach` are
    /// answered here; any other request passes once its peer has proved who it is and,
    /// naming an instance, has attached it (`trust_any`: planted bug
    /// `TrustAnyConnection`). A TCP peer that just proved a token moves from the
    /// strangers' share of the connections to its tenant's (row 67), or stays a
    /// stranger, refused, when that share is full.
    pub(super) fn pass(
        &mut self,
        conn: ConnId,
        connection: &mut Conn,
        op: &Op,
        op_name: &'static str,
        trust_any: bool,
    ) -> Result<(), Result<Answer, ProtocolError>> {
        let tcp = connection.transport == Transport::Tcp;
        if let Op::Auth { id, nonce } = op {
            return Err(if tcp {
                self.trust
                    .challenge(&mut connection.peer, id, nonce)
                    .map(Answer::Challenge)
            } else {
                Err(ProtocolError::new(
                    ErrorCode::BadArgs,
                    "`auth` is for TCP connections: over the Unix socket the server knows its \
                     peer by its uid; say `hello`",
                ))
            });
        }
        let peer = &mut connection.peer;
        let checked = match op {
            Op::Hello { proof, token, .. } if tcp => {
                self.trust
                    .authenticate(peer, proof.as_deref(), token.as_deref())
            }
            Op::Hello { .. } => Ok(()),
            Op::Attach { .. } => self.trust.require_identity(peer, op_name),
            _ => self
                .trust
                .require_identity(peer, op_name)
                .and_then(|()| match op.instance() {
                    Some(_) if trust_any => Ok(()),
                    Some(instance) => self.trust.check(peer, instance, op_name),
                    None => Ok(()),
                }),
        };
        checked.map_err(Err)?;
        if tcp
            && connection.holder == admission::Holder::Stranger
            && let Some(tenant) = connection.peer.tenant()
        {
            match self.admission.authenticated(conn, tenant.0) {
                Ok(holder) => connection.holder = holder,
                Err(refused) => {
                    self.trust.forget_identity(&mut connection.peer);
                    return Err(Err(ProtocolError::new(
                        ErrorCode::Overloaded,
                        format!(
                            "`hello`: {refused}; close one of its connections, or raise \
                             --max-connections-per-uid"
                        ),
                    )));
                }
            }
        }
        if let Op::Attach { instance, secret } = op {
            return Err(self
                .trust
                .attach(&mut connection.peer, *instance, secret)
                .map(Answer::Attached));
        }
        Ok(())
    }
}
