//! Unit tests of the region's constructors.

use super::*;

#[test]
fn rows_are_page_aligned_and_distinct() {
    let r = PrimaryRegion::create(8, 8192).unwrap();
    assert_eq!(r.len(), 65536);
    assert!(r.is_owned());
    assert!(r.fd().is_some());
    assert_ne!(r.prefault_method(), PrefaultMethod::None);
    for c in 0..8 {
        let p = r.row_ptr(c).unwrap() as usize;
        assert_eq!(p % ROW_ALIGNMENT, 0);
        assert_eq!(p - r.base_ptr() as usize, c * 8192);
    }
    assert_eq!(r.row_ptr(8).unwrap_err().kind(), ErrorKind::Contract);
    r.write_row(3).unwrap().fill(0xAB);
    assert!(r.read_row(3).unwrap().iter().all(|&b| b == 0xAB));
    assert!(r.read_row(2).unwrap().iter().all(|&b| b == 0));
}

#[test]
fn bad_geometry_is_rejected() {
    assert_eq!(
        PrimaryRegion::create(4, 1000).unwrap_err().kind(),
        ErrorKind::Misaligned
    );
    assert_eq!(
        PrimaryRegion::create(0, 4096).unwrap_err().kind(),
        ErrorKind::Config
    );
    assert_eq!(
        PrimaryRegion::create(usize::MAX / 4096, 8192)
            .unwrap_err()
            .kind(),
        ErrorKind::Config
    );
}

#[test]
fn a_shared_file_maps_the_owners_rows_and_a_short_file_is_refused() {
    let owner = PrimaryRegion::create(4, 4096).unwrap();
    let fd = owner.fd().unwrap().try_clone_to_owned().unwrap();
    let mapped = PrimaryRegion::map_shared_file(&fd, 4, 4096).unwrap();
    assert!(!mapped.is_owned());
    assert_ne!(mapped.base_ptr(), owner.base_ptr());
    owner.write_row(2).unwrap().fill(0x5A);
    assert!(mapped.read_row(2).unwrap().iter().all(|&b| b == 0x5A));
    mapped.write_row(1).unwrap().fill(0xC3);
    assert!(owner.read_row(1).unwrap().iter().all(|&b| b == 0xC3));
    drop(mapped);
    let err = PrimaryRegion::map_shared_file(&fd, 5, 4096).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(err.message().contains("16384 bytes"), "{err}");
}

#[test]
fn adopt_checks_alignment_and_never_unmaps() {
    let owner = PrimaryRegion::create(2, 4096).unwrap();
    // SAFETY: `owner` outlives `adopted`.
    let adopted = unsafe { PrimaryRegion::adopt(owner.base_ptr(), 4096, 2) }.unwrap();
    assert!(!adopted.is_owned());
    assert_eq!(adopted.row_ptr(1).unwrap(), owner.row_ptr(1).unwrap());
    drop(adopted);
    owner.write_row(1).unwrap()[0] = 1;
    // SAFETY: pointer + 8 is inside `owner` but misaligned; adopt must refuse it.
    let err = unsafe { PrimaryRegion::adopt(owner.base_ptr().add(8), 4096, 1) }.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Misaligned);
}
