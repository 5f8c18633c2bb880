//! The handshake (`HELLO`, answered `WELCOME` or refused) and observer sessions.

use std::os::unix::net::UnixStream;
use std::sync::Arc;

use super::shared::{SOCKET_TIMEOUT, ServiceShared, error_reply};
use super::status::status_json;
use crate::error::{Error, ErrorKind, Result};
use crate::node::engines::EngineEntry;
use crate::node::protocol::{Reply, Request};
use crate::node::socket::{FrameReader, write_frame};

/// Reads the `HELLO`, checks the digest and that the engine's rows hold a slot, answers
/// `WELCOME` (with the slot size) or the refusal. Returns the engine and its row stride.
///
/// A `HELLO` with row stride 0 and an all-zero digest opens an observer session (`kvtier
/// service status`): `Ok(None)`.
pub(super) fn handshake(
    sh: &ServiceShared,
    stream: &UnixStream,
    uid: u32,
    pid: i32,
) -> Result<Option<(Arc<EngineEntry>, u64)>> {
    stream
        .set_read_timeout(Some(SOCKET_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(SOCKET_TIMEOUT)))
        .map_err(|e| Error::new(ErrorKind::Io, format!("socket timeouts: {e}")))?;
    let mut reader = FrameReader::new(
        stream
            .try_clone()
            .map_err(|e| Error::new(ErrorKind::Io, format!("cannot clone the socket: {e}")))?,
    );
    let frame = reader
        .read_frame()?
        .ok_or_else(|| Error::new(ErrorKind::Closed, "closed before HELLO"))?;
    let refuse = |e: Error| {
        let _ = write_frame(stream, &error_reply(&e).to_frame(frame.seq));
        e
    };
    let (row_stride, digest, engine) = match Request::from_frame(&frame) {
        Ok(Request::Hello {
            row_stride,
            digest,
            engine,
        }) => (row_stride, digest, engine),
        Ok(_) => {
            return Err(refuse(Error::new(
                ErrorKind::Contract,
                "the first request must be HELLO",
            )));
        }
        Err(e) => return Err(refuse(e)),
    };
    let welcome = Reply::Welcome {
        row_stride: sh.slot_bytes,
        digest: sh.digest,
        version: env!("CARGO_PKG_VERSION").to_string(),
    };
    if row_stride == 0 && digest == [0; 32] {
        write_frame(stream, &welcome.to_frame(frame.seq))?;
        return Ok(None);
    }
    if digest != sh.digest {
        // An engine whose rows are larger than the slots presents its whole row unless its
        // tier entry names the layout (the canonical area, replicated GQA heads).
        let layout_hint = if row_stride > sh.slot_bytes {
            format!(
                "; its rows ({row_stride} bytes) are larger than the service's slots ({} \
                 bytes): if they hold the model's canonical area (replicated KV heads with \
                 canonical_layout), set the tier entry's layout key (a shipped layout name \
                 or a descriptor path) so that the engine presents the area",
                sh.slot_bytes
            )
        } else {
            String::new()
        };
        return Err(refuse(Error::new(
            ErrorKind::IncompatibleLayout,
            format!(
                "compatibility digest mismatch: engine {engine:?} has {}, the service has {} \
                 (the model, dtype, layout, TP size, blocks per chunk or canonical_layout \
                 differ; start the engine with the service's configuration or run a service \
                 for it){layout_hint}",
                hex::encode(digest),
                hex::encode(sh.digest)
            ),
        )));
    }
    if row_stride < sh.slot_bytes {
        return Err(refuse(Error::new(
            ErrorKind::IncompatibleLayout,
            format!(
                "row stride mismatch: engine {engine:?} has rows of {row_stride} bytes, smaller \
                 than the service's slots of {} bytes (each row must hold a slot)",
                sh.slot_bytes
            ),
        )));
    }
    // Past the handshake, an engine may stay quiet as long as it likes; a reply it does not
    // take within the timeout still ends the session.
    stream
        .set_read_timeout(None)
        .map_err(|e| Error::new(ErrorKind::Io, format!("socket timeout: {e}")))?;
    write_frame(stream, &welcome.to_frame(frame.seq))?;
    Ok(Some((sh.engines.add(engine, uid, pid), row_stride)))
}

/// An observer session: `STATUS` only, until the peer closes or a read times out.
pub(super) fn observe(sh: &ServiceShared, stream: UnixStream) {
    let Ok(read_side) = stream.try_clone() else {
        return;
    };
    let mut reader = FrameReader::new(read_side);
    while let Ok(Some(frame)) = reader.read_frame() {
        let reply = match Request::from_frame(&frame) {
            Ok(Request::Status) => Reply::Status(status_json(sh)),
            Ok(_) => error_reply(&Error::new(
                ErrorKind::Contract,
                "an observer session (row stride 0) may only ask for STATUS",
            )),
            Err(e) => error_reply(&e),
        };
        if write_frame(&stream, &reply.to_frame(frame.seq)).is_err() {
            return;
        }
    }
}
