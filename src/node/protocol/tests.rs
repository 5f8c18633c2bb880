//! The frames byte for byte, round trips, and bodies refused without a panic.

use super::frame::{KIND_LOOKUP, MAX_BODY};
use super::*;
use crate::contract::job::LookupResult;
use crate::error::ErrorKind;
use crate::key::ChunkKey;

fn round_trip_request(req: Request) {
    let bytes = req.to_frame(7).unwrap().to_bytes();
    let mut h = [0u8; HEADER_LEN];
    h.copy_from_slice(&bytes[..HEADER_LEN]);
    let head = Header::parse(&h).unwrap();
    assert_eq!(head.seq, 7);
    assert_eq!(head.body_len as usize, bytes.len() - HEADER_LEN);
    let f = Frame {
        kind: head.kind,
        seq: head.seq,
        body: bytes[HEADER_LEN..].to_vec(),
    };
    assert_eq!(Request::from_frame(&f).unwrap(), req);
}

#[test]
fn a_hello_is_the_documented_bytes() {
    let f = Request::Hello {
        row_stride: 0x2000,
        digest: [0xAB; 32],
        engine: "dp0".into(),
    }
    .to_frame(1)
    .unwrap()
    .to_bytes();
    let mut want = vec![];
    want.extend_from_slice(&[53, 0, 0, 0, 0x01, 0x00, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]);
    want.extend_from_slice(b"KVTN");
    want.extend_from_slice(&[1, 0, 0, 0]);
    want.extend_from_slice(&[0x00, 0x20, 0, 0, 0, 0, 0, 0]);
    want.extend_from_slice(&[0xAB; 32]);
    want.extend_from_slice(&[3, 0]);
    want.extend_from_slice(b"dp0");
    assert_eq!(f, want);
}

#[test]
fn requests_round_trip() {
    round_trip_request(Request::RegisterPath {
        num_rows: 12,
        path: "/dev/shm/vllm_offload_e.mmap".into(),
    });
    round_trip_request(Request::RegisterFd { num_rows: 3 });
    round_trip_request(Request::Lookup {
        keys: vec![ChunkKey::new(b"a"), ChunkKey::new([0u8; 36])],
    });
    round_trip_request(Request::Store(JobRequest {
        job_id: u64::MAX,
        rows: vec![0, 9],
        keys: vec![ChunkKey::new(b"k0"), ChunkKey::new(b"k1")],
    }));
    round_trip_request(Request::Load(JobRequest {
        job_id: 5,
        rows: vec![],
        keys: vec![],
    }));
    round_trip_request(Request::Status);
    round_trip_request(Request::Hint {
        req_id: "req-1".into(),
        keys: vec![ChunkKey::new([7u8; 36])],
    });
    round_trip_request(Request::HintDone {
        req_id: "req-1".into(),
    });
    round_trip_request(Request::TakeEvents);
    round_trip_request(Request::Touch {
        keys: vec![ChunkKey::new([3u8; 36]), ChunkKey::new(b"t")],
    });
}

#[test]
fn replies_round_trip() {
    for reply in [
        Reply::Welcome {
            row_stride: 4096,
            digest: [1; 32],
            version: "0.1.0".into(),
        },
        Reply::Registered { num_rows: 4 },
        Reply::Lookup(vec![
            LookupResult::Hit,
            LookupResult::Miss,
            LookupResult::Retry,
        ]),
        Reply::JobDone(JobDone {
            job_id: 3,
            success: false,
            transfer_bytes: 4096,
            transfer_ns: 1000,
            loaded: Some(vec![0, 2]),
            error: Some((ErrorKind::Checksum, "key 01: CRC".into())),
        }),
        Reply::JobDone(JobDone {
            job_id: 4,
            success: true,
            transfer_bytes: 0,
            transfer_ns: 0,
            loaded: None,
            error: None,
        }),
        Reply::Status("{\"engines\":[]}".into()),
        Reply::Hinted(vec![LookupResult::Hit, LookupResult::Miss]),
        Reply::Events(vec![
            InventoryEvent {
                medium: EventMedium::Cpu,
                removed: false,
                keys: vec![ChunkKey::new(b"a"), ChunkKey::new(b"b")],
            },
            InventoryEvent {
                medium: EventMedium::Storage,
                removed: true,
                keys: vec![],
            },
        ]),
        Reply::Error {
            kind: ErrorKind::PermissionDenied,
            message: "uid 65534".into(),
        },
    ] {
        let f = reply.to_frame(9);
        assert_eq!(Reply::from_frame(&f).unwrap(), reply);
    }
}

#[test]
fn truncated_oversized_and_trailing_bodies_are_refused_without_panicking() {
    let f = Request::Lookup {
        keys: vec![ChunkKey::new(b"abc")],
    }
    .to_frame(1)
    .unwrap();
    for cut in 0..f.body.len() {
        let g = Frame {
            body: f.body[..cut].to_vec(),
            ..f.clone()
        };
        assert_eq!(
            Request::from_frame(&g).unwrap_err().kind(),
            ErrorKind::Contract
        );
    }
    let mut g = f.clone();
    g.body.push(0);
    assert!(
        Request::from_frame(&g)
            .unwrap_err()
            .message()
            .contains("after the end")
    );
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&(MAX_BODY + 1).to_le_bytes());
    assert!(Header::parse(&h).is_err());
    // A count far beyond the body is refused before anything is allocated for it.
    let huge = Frame {
        kind: KIND_LOOKUP,
        seq: 1,
        body: u32::MAX.to_le_bytes().to_vec(),
    };
    assert!(Request::from_frame(&huge).is_err());
}
