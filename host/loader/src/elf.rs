//! Structural checks of an ELF64 shared object, made with plain file reads before `dlopen`.

use super::*;

const MAGIC: [u8; 4] = [0x7f, b'E', b'L', b'F'];
const ELFCLASS64: u8 = 2;
const ELFDATA2LSB: u8 = 1;
const ELFDATA2MSB: u8 = 2;
const ET_DYN: u16 = 3;
const PT_LOAD: u32 = 1;
const PN_XNUM: u16 = 0xffff;
const EHDR_SIZE: u64 = 64;
const PHDR_SIZE: u64 = 56;
const SHDR_SIZE: u64 = 64;

/// The ELF machine of this build, if known.
const fn host_machine() -> Option<(u16, &'static str)> {
    if cfg!(target_arch = "x86_64") {
        Some((62, "x86_64"))
    } else if cfg!(target_arch = "aarch64") {
        Some((183, "aarch64"))
    } else if cfg!(target_arch = "riscv64") {
        Some((243, "riscv64"))
    } else if cfg!(target_arch = "powerpc64") {
        Some((21, "powerpc64"))
    } else if cfg!(target_arch = "s390x") {
        Some((22, "s390x"))
    } else if cfg!(target_arch = "loongarch64") {
        Some((258, "loongarch64"))
    } else {
        None
    }
}

fn machine_name(machine: u16) -> &'static str {
    match machine {
        3 => "x86",
        40 => "arm",
        62 => "x86_64",
        183 => "aarch64",
        243 => "riscv",
        21 => "powerpc64",
        22 => "s390",
        258 => "loongarch",
        _ => "unknown",
    }
}

/// Reads fixed-width integers in the file's byte order.
struct Endian {
    little: bool,
}

impl Endian {
    fn u16(&self, b: &[u8], at: usize) -> u16 {
        let v = [b[at], b[at + 1]];
        if self.little {
            u16::from_le_bytes(v)
        } else {
            u16::from_be_bytes(v)
        }
    }

    fn u32(&self, b: &[u8], at: usize) -> u32 {
        let mut v = [0; 4];
        v.copy_from_slice(&b[at..at + 4]);
        if self.little {
            u32::from_le_bytes(v)
        } else {
            u32::from_be_bytes(v)
        }
    }

    fn u64(&self, b: &[u8], at: usize) -> u64 {
        let mut v = [0; 8];
        v.copy_from_slice(&b[at..at + 8]);
        if self.little {
            u64::from_le_bytes(v)
        } else {
            u64::from_be_bytes(v)
        }
    }
}

/// Checks that `path` is an ELF64 shared object for this machine whose header tables and
/// `PT_LOAD` segments all lie inside the file.
pub(super) fn check(path: &Path) -> Result<(), LoadError> {
    let read_error = |e: std::io::Error| LoadError::Read {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let not_elf = |detail: String| LoadError::NotElf {
        path: path.to_path_buf(),
        detail,
    };
    let mut file = File::open(path).map_err(read_error)?;
    let file_size = file.metadata().map_err(read_error)?.len();
    let past_end = |part: String, end: u64| LoadError::Truncated {
        path: path.to_path_buf(),
        part,
        end,
        file_size,
    };

    let mut ident = [0u8; 16];
    let ident_len = read_up_to(&mut file, &mut ident).map_err(read_error)?;
    if ident_len < 4 || ident[..4] != MAGIC {
        return Err(not_elf("bad magic".to_string()));
    }
    if file_size < EHDR_SIZE {
        return Err(past_end("ELF header".to_string(), EHDR_SIZE));
    }
    if ident[4] != ELFCLASS64 {
        return Err(not_elf(format!(
            "ELF class {}, expected 64-bit (2)",
            ident[4]
        )));
    }
    let little = match ident[5] {
        ELFDATA2LSB => true,
        ELFDATA2MSB => false,
        other => return Err(not_elf(format!("unknown byte order {other}"))),
    };
    if little != cfg!(target_endian = "little") {
        return Err(not_elf(format!(
            "{} byte order, this host is {}",
            if little {
                "little-endian"
            } else {
                "big-endian"
            },
            if little {
                "big-endian"
            } else {
                "little-endian"
            },
        )));
    }
    let e = Endian { little };
    let mut header = [0u8; EHDR_SIZE as usize];
    file.seek(SeekFrom::Start(0)).map_err(read_error)?;
    file.read_exact(&mut header).map_err(read_error)?;

    let e_type = e.u16(&header, 16);
    if e_type != ET_DYN {
        let what = match e_type {
            1 => "a relocatable object",
            2 => "an executable",
            4 => "a core dump",
            _ => "an unknown object type",
        };
        return Err(not_elf(format!(
            "object type {e_type} ({what}), expected a shared object (3)"
        )));
    }
    let machine = e.u16(&header, 18);
    if let Some((host, host_name)) = host_machine() {
        if machine != host {
            return Err(not_elf(format!(
                "machine {machine} ({}), this host is {host_name}",
                machine_name(machine)
            )));
        }
    }
    let phoff = e.u64(&header, 32);
    let shoff = e.u64(&header, 40);
    let phentsize = u64::from(e.u16(&header, 54));
    let phnum_field = e.u16(&header, 56);
    let shentsize = u64::from(e.u16(&header, 58));
    let shnum_field = e.u16(&header, 60);

    // Section header table. With more than 0xff00 sections, e_shnum is 0 and the count is
    // section 0's sh_size; with more than 0xfffe program headers, e_phnum is PN_XNUM and
    // the count is section 0's sh_info.
    let mut shnum = u64::from(shnum_field);
    let mut phnum = u64::from(phnum_field);
    if shoff != 0 {
        if shentsize < SHDR_SIZE {
            return Err(not_elf(format!(
                "section header entry size {shentsize}, expected at least {SHDR_SIZE}"
            )));
        }
        if shnum_field == 0 || phnum_field == PN_XNUM {
            let end = table_end(shoff, 1, shentsize)
                .ok_or_else(|| not_elf("section header offset overflows".to_string()))?;
            if end > file_size {
                return Err(past_end("section header table".to_string(), end));
            }
            let mut section0 = [0u8; SHDR_SIZE as usize];
            file.seek(SeekFrom::Start(shoff)).map_err(read_error)?;
            file.read_exact(&mut section0).map_err(read_error)?;
            if shnum_field == 0 {
                shnum = e.u64(&section0, 32);
            }
            if phnum_field == PN_XNUM {
                phnum = u64::from(e.u32(&section0, 44));
            }
        }
    }

    // Program header table and PT_LOAD segments: the parts `dlopen` maps and touches.
    if phnum == 0 {
        return Err(not_elf("no program headers".to_string()));
    }
    if phentsize < PHDR_SIZE {
        return Err(not_elf(format!(
            "program header entry size {phentsize}, expected at least {PHDR_SIZE}"
        )));
    }
    let ph_end = table_end(phoff, phnum, phentsize)
        .ok_or_else(|| not_elf("program header table offset overflows".to_string()))?;
    if ph_end > file_size {
        return Err(past_end("program header table".to_string(), ph_end));
    }
    let mut table = vec![0u8; (ph_end - phoff) as usize];
    file.seek(SeekFrom::Start(phoff)).map_err(read_error)?;
    file.read_exact(&mut table).map_err(read_error)?;
    for (index, entry) in table.chunks_exact(phentsize as usize).enumerate() {
        if e.u32(entry, 0) != PT_LOAD {
            continue;
        }
        let offset = e.u64(entry, 8);
        let filesz = e.u64(entry, 32);
        let end = offset
            .checked_add(filesz)
            .ok_or_else(|| not_elf(format!("PT_LOAD segment {index}: file range overflows")))?;
        if end > file_size {
            return Err(past_end(format!("PT_LOAD segment {index}"), end));
        }
    }

    if shoff != 0 {
        let sh_end = table_end(shoff, shnum, shentsize)
            .ok_or_else(|| not_elf("section header table offset overflows".to_string()))?;
        if sh_end > file_size {
            return Err(past_end("section header table".to_string(), sh_end));
        }
    }
    Ok(())
}

fn table_end(offset: u64, count: u64, entsize: u64) -> Option<u64> {
    count.checked_mul(entsize)?.checked_add(offset)
}

/// Reads into `buf` until it is full or the file ends; returns the bytes read.
fn read_up_to(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}
