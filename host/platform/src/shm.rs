//! Who created a System V shared-memory segment: the kernel's word on the owner of a segment
//! a peer's remote key names (UCX's `sysv` keys carry the segment id and no owner).

use std::io;

/// The process that created System V shared-memory segment `shmid` (`shmctl(IPC_STAT)`'s
/// `shm_cpid`, in this process's pid namespace), and the segment's size in bytes.
///
/// # Errors
///
/// The OS's: no such segment (`EINVAL`; UCX marks its segments for removal once attached,
/// and a removed one is gone once its last process detaches), or no permission to read it
/// (`EACCES`).
pub fn sysv_segment_creator(shmid: i32) -> io::Result<(u32, u64)> {
    // SAFETY: `shmid_ds` is plain data; all zeroes is a valid value for it.
    let mut ds: libc::shmid_ds = unsafe { std::mem::zeroed() };
    // SAFETY: IPC_STAT writes one `shmid_ds` through the pointer, which is valid and writable
    // for the call; any id is safe to ask about (an unknown one fails with EINVAL).
    let rc = unsafe { libc::shmctl(shmid, libc::IPC_STAT, &mut ds) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((ds.shm_cpid as u32, ds.shm_segsz as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_segment_made_here_is_this_process_and_an_unknown_one_is_an_error() {
        // SAFETY: a private segment of one page, created and removed by this test alone.
        let id = unsafe { libc::shmget(libc::IPC_PRIVATE, 4096, libc::IPC_CREAT | 0o600) };
        assert!(id >= 0, "{}", io::Error::last_os_error());
        let got = sysv_segment_creator(id);
        // SAFETY: the id made above; removal of a segment nothing has attached.
        unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) };
        let (pid, size) = got.unwrap();
        assert_eq!(pid, std::process::id());
        assert_eq!(size, 4096);
        assert!(sysv_segment_creator(-1).is_err());
    }
}
