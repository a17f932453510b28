//! Pure tests; those of real processes (forked children, python3 interpreters captured
//! twice around an action) are the root-only `tests/root_memory.rs`.
use super::*;
use std::os::fd::AsRawFd;

#[test]
fn fdinfo_is_kept_within_the_budget_then_hashed() {
    let small = "pos:\t0\nflags:\t02\nit_value: (0,5)\n";
    let mut budget = 1 << 20;
    assert_eq!(
        fdinfo_lines(small.as_bytes(), &mut budget),
        vec!["pos: 0", "flags: 02"]
    );
    assert_eq!(budget, (1 << 20) - 7 - 10);
    // An epoll fd watching 200000 fds: a few KiB kept, then one hash line.
    let big: String = (0..200_000)
        .map(|i| format!("tfd: {i:8} events: 19 data: {i:16x} pos:0 ino:1 sdev:e\n"))
        .collect();
    let mut budget = 4096;
    let lines = fdinfo_lines(big.as_bytes(), &mut budget);
    let kept: usize = lines.iter().map(|l| l.len() + 1).sum();
    assert!(kept < 4096 + 100, "{kept}");
    assert!(
        lines.last().unwrap().starts_with("xxh3 "),
        "{:?}",
        lines.last()
    );
    // Exact enough: one changed watch shows.
    let changed = big.replacen("tfd:   199999 events: 19", "tfd:   199999 events: 1b", 1);
    assert_ne!(changed, big);
    assert_ne!(fdinfo_lines(changed.as_bytes(), &mut 4096), lines);
    assert_eq!(fdinfo_lines(big.as_bytes(), &mut 4096), lines);
    // A spent budget hashes everything, it-value lines still left out.
    let mut spent = 0;
    let a = fdinfo_lines("x: 1\nit_value: (0,1)\n".as_bytes(), &mut spent);
    let b = fdinfo_lines("x: 1\nit_value: (0,2)\n".as_bytes(), &mut spent);
    assert_eq!(a, b);
    assert_eq!(a.len(), 1);
}
#[test]
fn ranges_left_to_read_and_merged() {
    let covered = vec![(10, 20), (30, 40)];
    assert_eq!(
        uncovered(&covered, 0, 50),
        vec![(0, 10), (20, 30), (40, 50)]
    );
    assert_eq!(uncovered(&covered, 12, 18), vec![]);
    assert_eq!(uncovered(&covered, 15, 35), vec![(20, 30)]);
    assert_eq!(uncovered(&covered, 40, 45), vec![(40, 45)]);
    assert_eq!(uncovered(&[], 5, 6), vec![(5, 6)]);
    let mut c = covered.clone();
    cover(&mut c, (20, 30));
    assert_eq!(c, vec![(10, 40)]);
    cover(&mut c, (0, 5));
    cover(&mut c, (50, 60));
    cover(&mut c, (45, 50));
    assert_eq!(c, vec![(0, 5), (10, 40), (45, 60)]);
    cover(&mut c, (3, 70));
    assert_eq!(c, vec![(0, 70)]);
    assert_eq!(
        merge_sorted(&[(1, 9), (5, 9)], &[(0, 7), (3, 7), (8, 7)]),
        vec![(0, 7), (1, 9), (3, 7), (5, 9), (8, 7)]
    );
}

#[test]
fn a_bound_passed_is_named_and_stays_passed() {
    let mut b = Observation::new(8192, 100).budget;
    assert!(b.memory(8192).is_ok());
    let e = b.memory(1).unwrap_err().to_string();
    assert!(
        e.contains("[limits] max_memory_image_bytes") && e.contains("8192"),
        "{e}"
    );
    // Everything after fails the same way, fdinfo too.
    assert_eq!(b.fdinfo(1).unwrap_err().to_string(), e);
    assert_eq!(b.fdinfo_left(), 0);
    let mut b = Observation::new(u64::MAX, 100).budget;
    assert_eq!(b.fdinfo_left(), 100);
    b.fdinfo(60).unwrap();
    assert_eq!(b.fdinfo_left(), 40);
    let e = b.fdinfo(41).unwrap_err().to_string();
    assert!(e.contains("[limits] max_fdinfo_total_bytes"), "{e}");
    assert!(b.memory(0).is_err());
}

/// Held by the tests that map memfds into this process (one of them captures it).
static MAPS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A shared mapping of this process, unmapped when dropped.
struct Mapping(*mut u8, usize);

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: a mapping this test made and no longer uses.
        unsafe { libc::munmap(self.0 as *mut libc::c_void, self.1) };
    }
}

/// A memfd of `pages` pages with data in every page but the holes of `holes`, mapped
/// shared in this process.
fn memfd(pages: usize, holes: &[usize]) -> (File, Mapping) {
    use std::os::fd::FromRawFd;
    let ps = page_size() as usize;
    // SAFETY: plain syscalls on a new fd; the mapping is used by the caller's test only.
    unsafe {
        let fd = libc::memfd_create(c"crab-test".as_ptr(), libc::MFD_CLOEXEC);
        assert!(fd >= 0);
        let f = File::from_raw_fd(fd);
        f.set_len((pages * ps) as u64).unwrap();
        for p in (0..pages).filter(|p| !holes.contains(p)) {
            f.write_at(&[(p % 200) as u8 + 1; 8], (p * ps) as u64)
                .unwrap();
        }
        let a = libc::mmap(
            std::ptr::null_mut(),
            pages * ps,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        );
        assert_ne!(a, libc::MAP_FAILED);
        (f, Mapping(a as *mut u8, pages * ps))
    }
}

#[test]
fn an_object_is_read_once_per_observation_whatever_maps_it() {
    let _l = MAPS.lock().unwrap_or_else(|e| e.into_inner());
    let ps = page_size();
    let (f, _m) = memfd(64, &[3]);
    let id = shmem_id(&f).unwrap();
    let mut obs = Observation::unbounded();
    // The first mapper reads it: 63 data pages (page 3 is a hole: not read, not listed).
    let a = obs.object_pages(&f, id, 0, 64 * ps).unwrap();
    assert_eq!((a.pages_read, a.reused_pages, a.hashes.len()), (63, 0, 63));
    // 63 more mappers of the same range read nothing and share the list.
    for _ in 0..63 {
        let b = obs.object_pages(&f, id, 0, 64 * ps).unwrap();
        assert_eq!((b.pages_read, b.reused_pages), (0, 64));
        assert!(std::sync::Arc::ptr_eq(&a.hashes, &b.hashes));
    }
    let st = obs.stats().clone();
    assert_eq!(st.shared_objects, 1);
    assert_eq!(st.shared_bytes, 63 * ps);
    assert_eq!(st.memory_bytes, 63 * ps);
    assert_eq!(st.shared_bytes_reused, 63 * 64 * ps);
    // Mappings of other ranges read only what is new; the list then covers all of it.
    let mut obs = Observation::unbounded();
    let first = obs.object_pages(&f, id, 8 * ps, 16 * ps).unwrap();
    assert_eq!(first.pages_read, 8);
    let wider = obs.object_pages(&f, id, 0, 32 * ps).unwrap();
    assert_eq!((wider.pages_read, wider.reused_pages), (23, 8));
    assert_eq!(obs.stats().memory_bytes, 31 * ps);
    assert_eq!(wider.hashes.len(), 31);
    assert_eq!(
        &wider.hashes[7..15],
        &first.hashes[..],
        "the same hashes where both read"
    );
    // settle points an earlier image at the final list.
    let region = |hashes| Region {
        start: 0x10000,
        end: 0x10000 + 8 * ps,
        perms: "rw-s".into(),
        offset: 8 * ps,
        dev: "00:01".into(),
        inode: id.ino,
        name: "/memfd:crab-test (deleted)".into(),
        kind: RegionKind::Shmem,
        pages: Vec::new(),
        shared: Some(SharedRef { id, hashes }),
    };
    let mut img = image(vec![region(first.hashes.clone())]);
    let before = img.regions[0].page_hashes().into_owned();
    obs.settle(&mut img);
    let s = img.regions[0].shared.as_ref().unwrap();
    assert!(std::sync::Arc::ptr_eq(&s.hashes, &wider.hashes));
    assert_eq!(img.regions[0].page_hashes().into_owned(), before);
    assert_eq!(before.len(), 8);
    assert_eq!(before[0].0, 0x10000);
}

#[test]
fn reading_an_object_past_the_bound_fails_naming_the_key() {
    let _l = MAPS.lock().unwrap_or_else(|e| e.into_inner());
    let ps = page_size();
    let (f, _m) = memfd(512, &[]);
    let id = shmem_id(&f).unwrap();
    // 1 MiB of memory may be read; the object holds 2 MiB of data (4 KiB pages).
    let mut obs = Observation::new(1 << 20, u64::MAX);
    let e = match obs.object_pages(&f, id, 0, 512 * ps) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("read past the bound"),
    };
    assert!(e.contains("[limits] max_memory_image_bytes"), "{e}");
    assert!(obs.over_limit().is_some());
    // Nothing was kept of the object.
    assert!(obs.objects.get(&id).is_none_or(|o| o.covered.is_empty()));
}

fn image(regions: Vec<Region>) -> MemoryImage {
    MemoryImage {
        pid: 1,
        start_time: 1,
        regions,
        state: ProcState::default(),
        stats: CaptureStats::default(),
        masked: Vec::new(),
        interactions: None,
    }
}

#[test]
fn shared_regions_compare_by_their_object_pages() {
    let ps = page_size();
    let id = ShmemId { dev: 1, ino: 7 };
    // Mapped at 0x40000 from file offset 4 pages: file page k is at 0x40000 + (k - 4) pages.
    let region = |hashes: Vec<(u64, u64)>| Region {
        start: 0x40000,
        end: 0x40000 + 4 * ps,
        perms: "rw-s".into(),
        offset: 4 * ps,
        dev: "00:01".into(),
        inode: 7,
        name: "/memfd:x (deleted)".into(),
        kind: RegionKind::Shmem,
        pages: Vec::new(),
        shared: Some(SharedRef {
            id,
            hashes: std::sync::Arc::new(hashes),
        }),
    };
    // Pages outside the region's range (file pages 0 and 9) do not count.
    let a = image(vec![region(vec![
        (0, 5),
        (4 * ps, 1),
        (6 * ps, 2),
        (9 * ps, 3),
    ])]);
    let same = image(vec![region(vec![(4 * ps, 1), (6 * ps, 2)])]);
    assert!(compare(&a, &same).is_empty(), "{}", compare(&a, &same));
    let other = image(vec![region(vec![
        (0, 6),
        (4 * ps, 1),
        (6 * ps, 9),
        (9 * ps, 4),
    ])]);
    let d = compare(&a, &other);
    assert_eq!(
        (d.changed_pages, d.added_pages, d.removed_pages),
        (1, 0, 0),
        "{d}"
    );
    // A page written, a page zeroed.
    let moved = image(vec![region(vec![(4 * ps, 1), (5 * ps, 2)])]);
    assert_eq!(compare(&a, &moved).changed_pages, 2);
    assert_eq!(
        a.regions[0].page_hashes().into_owned(),
        vec![(0x40000, 1), (0x40000 + 2 * ps, 2)]
    );
    // Against the same region read through the process (addresses): equal.
    let mut through = region(Vec::new());
    through.shared = None;
    through.pages = vec![(0x40000, 1), (0x40000 + 2 * ps, 2)];
    assert!(compare(&a, &image(vec![through])).is_empty());
    // Serialized and back: the same image.
    let json = serde_json::to_string(&a).unwrap();
    assert_eq!(serde_json::from_str::<MemoryImage>(&json).unwrap(), a);
}

/// This process, with a filled memfd mapped shared twice: one observation reads the object
/// once for both mappings and both images; a refresh reads it again, once, and sees a
/// write; the bounds fail captures naming their keys.
#[test]
fn captures_of_one_observation_share_the_object() {
    let _l = MAPS.lock().unwrap_or_else(|e| e.into_inner());
    let ps = page_size();
    let (f, a) = memfd(256, &[]);
    // SAFETY: a second shared mapping of the same memfd.
    let b = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            256 * ps as usize,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(b, libc::MAP_FAILED);
    let _b = Mapping(b as *mut u8, 256 * ps as usize);
    let pid = std::process::id();
    let mut obs = Observation::unbounded();
    let one = capture_in(pid, &CaptureOptions::default(), &mut obs).unwrap();
    let two = capture_in(pid, &CaptureOptions::default(), &mut obs).unwrap();
    let id = shmem_id(&f).unwrap();
    let ours = |img: &MemoryImage| -> Vec<Region> {
        img.regions
            .iter()
            .filter(|r| r.shared.as_ref().is_some_and(|s| s.id == id))
            .cloned()
            .collect()
    };
    assert_eq!(ours(&one).len(), 2, "both mappings are shared regions");
    // Read once: the four regions (two mappings, two images) hold one list.
    let lists: Vec<_> = ours(&one)
        .into_iter()
        .chain(ours(&two))
        .map(|r| r.shared.unwrap().hashes)
        .collect();
    assert!(lists.iter().all(|l| std::sync::Arc::ptr_eq(l, &lists[0])));
    assert_eq!(obs.objects[&id].covered, vec![(0, 256 * ps)]);
    assert!(two.stats.shared_pages_reused >= 512, "{:?}", two.stats);
    for r in ours(&one).iter().chain(&ours(&two)) {
        assert_eq!(r.page_hashes().len(), 256);
    }
    // A write by anyone into the object: a refresh reads it once and sees one page.
    // SAFETY: page 5 of the 256-page mapping made above.
    unsafe { std::ptr::write_volatile(a.0.add(5 * ps as usize + 100), 0xee) };
    let mut obs = Observation::unbounded();
    let fresh = refresh_shared(&two, &mut obs)
        .unwrap()
        .expect("refreshable");
    assert_eq!(obs.objects[&id].covered, vec![(0, 256 * ps)]);
    assert_eq!(obs.stats().shared_bytes, fresh.stats.pages_read * ps);
    assert_eq!(
        obs.stats().carried_memory_bytes,
        two.stats.private_pages * ps
    );
    let theirs = ours(&fresh);
    let changed: u64 = ours(&two)
        .iter()
        .zip(&theirs)
        .map(|(x, y)| {
            differing_pages(
                &x.page_hashes(),
                &y.page_hashes(),
                x.start,
                x.end,
                &|_, _, _| false,
            )
        })
        .sum();
    assert_eq!(changed, 2, "page 5, seen through each mapping");
    // Bounds: memory, then fdinfo (this process's ~hundreds of bytes of fdinfo).
    let mut small = Observation::new(1 << 20, u64::MAX);
    let e = capture_in(pid, &CaptureOptions::default(), &mut small).unwrap_err();
    assert!(
        matches!(
            e,
            MemError::Limit {
                key: MEMORY_KEY,
                ..
            }
        ),
        "{e}"
    );
    let mut small = Observation::new(u64::MAX, 4096);
    let nulls: Vec<File> = (0..200).map(|_| File::open("/dev/null").unwrap()).collect();
    let e = capture_in(pid, &CaptureOptions::default(), &mut small).unwrap_err();
    assert!(
        e.to_string().contains("[limits] max_fdinfo_total_bytes"),
        "{e}"
    );
    assert!(small.stats().fdinfo_bytes <= 4097, "{:?}", small.stats());
    drop(nulls);
}
