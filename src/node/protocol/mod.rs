//! The node service's wire protocol: little-endian frames on a Unix stream socket, byte for
//! byte in `docs/node-service.md`.
//!
//! Every frame is a 16-byte header and a body:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 4 | `body_len`, u32: bytes of the body (at most `MAX_BODY`, 16 MiB) |
//! | 4 | 2 | `kind`, u16 (the `KIND_*` constants) |
//! | 6 | 2 | `flags`, u16: 0 (reserved) |
//! | 8 | 8 | `seq`, u64: the client's request number, echoed by the reply |
//!
//! Strings (`str16`) are a u16 byte count and UTF-8 bytes; keys (`key16`) a u16 byte count and
//! the key's bytes. Integers are little-endian.
//!
//! * `frame`: the header, the frame kinds, the limits.
//! * `messages`: what a client sends ([`Request`]) and what the service answers ([`Reply`]).
//! * `codec`: the body's writer and reader (integers, `str16`, `key16`, the greeting).
//! * `request`, `reply`: each message to and from its frame.

mod codec;
mod frame;
mod messages;
mod reply;
mod request;
#[cfg(test)]
mod tests;

pub use frame::{Frame, HEADER_LEN, Header};
pub use messages::{EventMedium, InventoryEvent, JobDone, JobRequest, Reply, Request};
