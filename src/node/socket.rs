//! Frames on a Unix stream socket: reading them together with descriptors passed as
//! `SCM_RIGHTS`, writing them (with one descriptor attached), the peer's credentials
//! (`SO_PEERCRED`) and binding the service's socket with its mode before it listens.

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketType,
};

use crate::error::{Error, ErrorKind, Result};
use crate::node::protocol::{Frame, HEADER_LEN, Header};

/// Descriptors a reader keeps waiting for a `REGISTER_FD` (more are closed at once).
const MAX_QUEUED_FDS: usize = 4;

/// Reads frames from a stream, collecting descriptors that arrive with the bytes.
#[derive(Debug)]
pub struct FrameReader {
    stream: UnixStream,
    buf: Vec<u8>,
    fds: VecDeque<OwnedFd>,
}

impl FrameReader {
    /// A reader of `stream` (a clone of the connection).
    pub fn new(stream: UnixStream) -> Self {
        FrameReader {
            stream,
            buf: Vec::with_capacity(64 * 1024),
            fds: VecDeque::new(),
        }
    }

    /// The next frame; `Ok(None)` when the peer closed the connection between frames.
    pub fn read_frame(&mut self) -> Result<Option<Frame>> {
        while self.buf.len() < HEADER_LEN {
            if self.fill()? == 0 {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(closed_mid_frame())
                };
            }
        }
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(&self.buf[..HEADER_LEN]);
        let head = Header::parse(&h)?;
        let total = HEADER_LEN + head.body_len as usize;
        while self.buf.len() < total {
            if self.fill()? == 0 {
                return Err(closed_mid_frame());
            }
        }
        let body = self.buf[HEADER_LEN..total].to_vec();
        self.buf.drain(..total);
        Ok(Some(Frame {
            kind: head.kind,
            seq: head.seq,
            body,
        }))
    }

    /// The oldest descriptor received and not yet taken.
    pub fn take_fd(&mut self) -> Option<OwnedFd> {
        self.fds.pop_front()
    }

    fn fill(&mut self) -> Result<usize> {
        let mut chunk = [0u8; 64 * 1024];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_QUEUED_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = loop {
            match rustix::net::recvmsg(
                &self.stream,
                &mut [IoSliceMut::new(&mut chunk)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            ) {
                Ok(m) => break m,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    return Err(Error::new(ErrorKind::Io, "reading the node socket failed")
                        .with_source(std::io::Error::from(e)));
                }
            }
        };
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = msg {
                for fd in fds {
                    if self.fds.len() < MAX_QUEUED_FDS {
                        self.fds.push_back(fd);
                    }
                }
            }
        }
        self.buf.extend_from_slice(&chunk[..got.bytes]);
        Ok(got.bytes)
    }
}

fn closed_mid_frame() -> Error {
    Error::new(
        ErrorKind::Closed,
        "the peer closed the connection inside a frame",
    )
}

/// Writes a whole frame.
pub fn write_frame(stream: &UnixStream, frame: &Frame) -> Result<()> {
    write_all(stream, &frame.to_bytes())
}

fn write_all(mut stream: &UnixStream, bytes: &[u8]) -> Result<()> {
    stream.write_all(bytes).map_err(|e| {
        Error::new(
            ErrorKind::Closed,
            format!("writing to the node socket failed: {e}"),
        )
        .with_source(e)
    })
}

/// Writes a whole frame with `fd` attached to its first byte (`SCM_RIGHTS`).
pub fn write_frame_with_fd(stream: &UnixStream, frame: &Frame, fd: BorrowedFd<'_>) -> Result<()> {
    let bytes = frame.to_bytes();
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [fd];
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(Error::new(ErrorKind::Internal, "no room for SCM_RIGHTS"));
    }
    let sent = loop {
        match rustix::net::sendmsg(
            stream,
            &[IoSlice::new(&bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Ok(n) => break n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                return Err(Error::new(ErrorKind::Closed, "sending a descriptor failed")
                    .with_source(std::io::Error::from(e)));
            }
        }
    };
    write_all(stream, &bytes[sent..])
}

/// The uid and pid of the process at the other end (`SO_PEERCRED`, taken at connect).
pub fn peer_credentials(stream: &UnixStream) -> Result<(u32, i32)> {
    let cred = rustix::net::sockopt::socket_peercred(stream).map_err(|e| {
        Error::new(ErrorKind::Io, "SO_PEERCRED failed").with_source(std::io::Error::from(e))
    })?;
    Ok((cred.uid.as_raw(), cred.pid.as_raw_nonzero().get()))
}

/// Binds a listening socket at `path` with permission bits `mode` (set before it listens, so
/// nobody connects through wider bits). A stale socket file nobody listens on is replaced; a
/// live one, or anything that is not a socket, is an error naming the path.
pub fn bind_listener(path: &Path, mode: u32) -> Result<UnixListener> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(Error::new(
                    ErrorKind::InvalidPath,
                    format!(
                        "{} exists and is not a socket; remove it or choose another \
                         service.socket_path",
                        path.display()
                    ),
                ));
            }
            if UnixStream::connect(path).is_ok() {
                return Err(Error::new(
                    ErrorKind::Locked,
                    format!(
                        "another kvtier service is listening on {}; stop it first",
                        path.display()
                    ),
                ));
            }
            std::fs::remove_file(path).map_err(|e| Error::io("remove stale socket", path, e))?;
            log::info!("removed the stale socket {}", path.display());
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("stat", path, e)),
    }
    let io = |op: &str, e: rustix::io::Errno| Error::io(op, path, std::io::Error::from(e));
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| io("socket", e))?;
    let addr = SocketAddrUnix::new(path).map_err(|e| io("socket address", e))?;
    rustix::net::bind(&sock, &addr).map_err(|e| io("bind", e))?;
    rustix::fs::chmod(path, rustix::fs::Mode::from_raw_mode(mode)).map_err(|e| io("chmod", e))?;
    rustix::net::listen(&sock, 128).map_err(|e| io("listen", e))?;
    Ok(UnixListener::from(sock))
}

/// A descriptor's access mode allows reading and writing.
pub fn is_read_write(fd: impl AsFd) -> bool {
    rustix::fs::fcntl_getfl(fd)
        .is_ok_and(|f| f & rustix::fs::OFlags::RWMODE == rustix::fs::OFlags::RDWR)
}
