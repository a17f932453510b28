//! Which pages of a mapping are present, swapped or the zero page: the `PAGEMAP_SCAN` ioctl,
//! or the pagemap read where the kernel lacks it.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::OnceLock;

use super::image::*;

// PAGEMAP_SCAN (linux/fs.h, 6.7+).
pub(super) const PAGE_IS_FILE: u64 = 1 << 2;
pub(super) const PAGE_IS_PRESENT: u64 = 1 << 3;
pub(super) const PAGE_IS_SWAPPED: u64 = 1 << 4;
pub(super) const PAGE_IS_PFNZERO: u64 = 1 << 5;

#[repr(C)]
#[derive(Default)]
pub(super) struct PmScanArg {
    pub(super) size: u64,
    pub(super) flags: u64,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) walk_end: u64,
    pub(super) vec: u64,
    pub(super) vec_len: u64,
    pub(super) max_pages: u64,
    pub(super) category_inverted: u64,
    pub(super) category_mask: u64,
    pub(super) category_anyof_mask: u64,
    pub(super) return_mask: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
pub(super) struct PageRegion {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) categories: u64,
}

// _IOWR('f', 16, struct pm_scan_arg)
pub(super) const PAGEMAP_SCAN: libc::c_ulong = (3 << 30)
    | ((std::mem::size_of::<PmScanArg>() as libc::c_ulong) << 16)
    | ((b'f' as libc::c_ulong) << 8)
    | 16;

/// Finds the pages of a range that are present or swapped, with their PAGE_IS_* categories.
pub(super) struct PresenceScanner<'a> {
    pub(super) pid: u32,
    pub(super) pagemap: &'a File,
    pub(super) ioctl_ok: bool,
    pub(super) vec: Vec<PageRegion>,
    pub(super) raw: Vec<u8>,
}

impl<'a> PresenceScanner<'a> {
    pub(super) fn new(pid: u32, pagemap: &'a File) -> Self {
        PresenceScanner {
            pid,
            pagemap,
            ioctl_ok: true,
            vec: vec![PageRegion::default(); 1024],
            raw: Vec::new(),
        }
    }

    /// Runs of `(start, end, categories)` in `[start, end)` that are present or swapped.
    pub(super) fn scan(&mut self, start: u64, end: u64) -> Result<Vec<(u64, u64, u64)>, MemError> {
        if self.ioctl_ok {
            match self.scan_ioctl(start, end) {
                Ok(v) => return Ok(v),
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTTY) | Some(libc::EINVAL)) => {
                    log::debug!("PAGEMAP_SCAN unavailable ({e}); reading pagemap");
                    self.ioctl_ok = false;
                }
                Err(e) => return Err(io_err(self.pid, "PAGEMAP_SCAN")(e)),
            }
        }
        self.scan_read(start, end)
    }

    pub(super) fn scan_ioctl(&mut self, start: u64, end: u64) -> io::Result<Vec<(u64, u64, u64)>> {
        let mut out: Vec<(u64, u64, u64)> = Vec::new();
        let mut pos = start;
        while pos < end {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                start: pos,
                end,
                vec: self.vec.as_mut_ptr() as u64,
                vec_len: self.vec.len() as u64,
                category_anyof_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
                return_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED | PAGE_IS_FILE | PAGE_IS_PFNZERO,
                ..Default::default()
            };
            // SAFETY: arg and vec are valid for the kernel to write; sizes given.
            let n = unsafe { libc::ioctl(self.pagemap.as_raw_fd(), PAGEMAP_SCAN as _, &mut arg) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            for r in &self.vec[..n as usize] {
                match out.last_mut() {
                    Some(l) if l.1 == r.start && l.2 == r.categories => l.1 = r.end,
                    _ => out.push((r.start, r.end, r.categories)),
                }
            }
            if arg.walk_end <= pos {
                break; // no progress: should not happen
            }
            pos = arg.walk_end;
        }
        Ok(out)
    }

    pub(super) fn scan_read(
        &mut self,
        start: u64,
        end: u64,
    ) -> Result<Vec<(u64, u64, u64)>, MemError> {
        const PRESENT: u64 = 1 << 63;
        const SWAPPED: u64 = 1 << 62;
        const FILE_OR_SHARED: u64 = 1 << 61;
        const PFN_MASK: u64 = (1 << 55) - 1;
        let ps = page_size();
        let zero_pfn = zero_pfn();
        let mut out: Vec<(u64, u64, u64)> = Vec::new();
        let mut va = start;
        const CHUNK: u64 = 32 * 1024;
        while va < end {
            let n = ((end - va) / ps).min(CHUNK);
            self.raw.resize((n * 8) as usize, 0);
            self.pagemap
                .read_exact_at(&mut self.raw, va / ps * 8)
                .map_err(io_err(self.pid, "pagemap"))?;
            for (i, e) in self.raw.chunks_exact(8).enumerate() {
                let e = u64::from_ne_bytes(e.try_into().unwrap());
                let mut cats = 0;
                if e & PRESENT != 0 {
                    cats |= PAGE_IS_PRESENT;
                    if zero_pfn.is_some_and(|z| z == e & PFN_MASK) {
                        cats |= PAGE_IS_PFNZERO;
                    }
                }
                if e & SWAPPED != 0 {
                    cats |= PAGE_IS_SWAPPED;
                }
                if e & FILE_OR_SHARED != 0 {
                    cats |= PAGE_IS_FILE;
                }
                if cats & (PAGE_IS_PRESENT | PAGE_IS_SWAPPED) == 0 {
                    continue;
                }
                let a = va + i as u64 * ps;
                match out.last_mut() {
                    Some(l) if l.1 == a && l.2 == cats => l.1 = a + ps,
                    _ => out.push((a, a + ps, cats)),
                }
            }
            va += n * ps;
        }
        Ok(out)
    }
}

/// The PFN of the kernel's shared zero page, read once from our own pagemap (pagemap fallback only).
pub(super) fn zero_pfn() -> Option<u64> {
    static Z: OnceLock<Option<u64>> = OnceLock::new();
    *Z.get_or_init(|| {
        let ps = page_size() as usize;
        // SAFETY: anonymous private mapping, read once to map the zero page, then unmapped.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                ps,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if p == libc::MAP_FAILED {
                return None;
            }
            std::ptr::read_volatile(p as *const u8);
            let f = File::open("/proc/self/pagemap").ok();
            let mut e = [0u8; 8];
            let r = f.and_then(|f| f.read_exact_at(&mut e, p as u64 / ps as u64 * 8).ok());
            libc::munmap(p, ps);
            r?;
            let e = u64::from_ne_bytes(e);
            (e >> 63 == 1 && e & ((1 << 55) - 1) != 0).then_some(e & ((1 << 55) - 1))
        }
    })
}
