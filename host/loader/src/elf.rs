//! The ELF pre-check made on every plugin file before `dlopen`.
//!
//! # Why
//!
//! A truncated `.so` (a partial copy) kills the process with SIGBUS inside `dlopen`: the
//! dynamic loader maps each `PT_LOAD` segment from the file and touches it, and a mapping that
//! runs past the end of the file faults on the first access beyond it. No error comes back
//! that the registry could turn into a [`LoadError`]. So before `dlopen`, [`check`] reads the
//! file's headers with plain file I/O and refuses any file the loader would trip on.
//!
//! # What is checked
//!
//! In order; the first failure is the reason given.
//!
//! 1. The ELF magic ([`NotElf`](LoadError::NotElf) `bad magic`), then the whole 64-byte ELF
//!    header inside the file ([`Truncated`](LoadError::Truncated) `ELF header`).
//! 2. The identification: 64-bit class, a known byte order that is the host's, ELF version
//!    1 ([`NotElf`](LoadError::NotElf)).
//! 3. The object type is a shared object (`ET_DYN`) and the machine is the host's (skipped on
//!    architectures not listed in [`HOST_MACHINE`]).
//! 4. Section 0, when the program or section header count overflows into it, inside the file.
//! 5. The program header table: present, entries of the ELF64 size, inside the file.
//! 6. Every `PT_LOAD` segment's file range (`p_offset + p_filesz`) inside the file: the check
//!    the SIGBUS calls for.
//! 7. The section header table, if any: entries of the ELF64 size, inside the file.
//! 8. When the file has a dynamic symbol table: it defines abi_stable's root-module loader
//!    symbol ([`NotAPlanner`](LoadError::NotAPlanner) otherwise), so a shared object that
//!    is not a planner (the C API's library next to the binaries) is never `dlopen`ed and
//!    its constructors never run here.
//!
//! The parsing is the [`object`] crate's: it decodes the header and tables in the file's byte
//! order, validates the identification and entry sizes, resolves the extended counts of
//! section 0, and refuses any table that does not fit in the file. Its errors are static
//! strings, so on a failure this module works out which part ran past the end, and where, for
//! the [`Truncated`](LoadError::Truncated) report. Segments are only compared with the file
//! length, never read.
//!
//! Only the headers are read, through a [`ReadCache`]: the ELF header, the program header
//! table, section 0 if needed, and the section header table; a few kilobytes for any real
//! library, whatever its size, and never more than the file holds. Segments are not read.
//! A read that fails with an I/O error is reported as [`Read`](LoadError::Read).

use std::cell::OnceCell;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::mem::size_of;
use std::path::Path;

use object::elf::{self, FileHeader64, Machine, ProgramHeader64, SectionHeader64};
use object::read::elf::{FileHeader, ProgramHeader, Sym};
use object::read::{ReadCache, ReadCacheOps, ReadRef};
use object::{Endianness, read::Error as ObjectError};

use crate::LoadError;

/// The ELF header of a 64-bit file, in the byte order it declares.
type Header = FileHeader64<Endianness>;

/// The ELF machine of this build and its name, where known; elsewhere the machine is not
/// checked.
const HOST_MACHINE: Option<(Machine, &str)> = if cfg!(target_arch = "x86_64") {
    Some((elf::EM_X86_64, "x86_64"))
} else if cfg!(target_arch = "aarch64") {
    Some((elf::EM_AARCH64, "aarch64"))
} else if cfg!(target_arch = "riscv64") {
    Some((elf::EM_RISCV, "riscv64"))
} else if cfg!(target_arch = "powerpc64") {
    Some((elf::EM_PPC64, "powerpc64"))
} else if cfg!(target_arch = "s390x") {
    Some((elf::EM_S390, "s390x"))
} else if cfg!(target_arch = "loongarch64") {
    Some((elf::EM_LOONGARCH, "loongarch64"))
} else {
    None
};

/// A short name for the machines a planner library is likely to have been built for.
fn machine_name(machine: Machine) -> &'static str {
    match machine {
        elf::EM_386 => "x86",
        elf::EM_ARM => "arm",
        elf::EM_X86_64 => "x86_64",
        elf::EM_AARCH64 => "aarch64",
        elf::EM_RISCV => "riscv",
        elf::EM_PPC64 => "powerpc64",
        elf::EM_S390 => "s390",
        elf::EM_LOONGARCH => "loongarch",
        _ => "unknown",
    }
}

/// Checks that `path` is an ELF64 shared object for this machine whose header tables and
/// `PT_LOAD` segments all lie inside the file (see the module documentation).
pub(crate) fn check(path: &Path) -> Result<(), LoadError> {
    let file = File::open(path).map_err(|e| read_error(path, &e))?;
    let file_size = file.metadata().map_err(|e| read_error(path, &e))?.len();
    let io_error = OnceCell::new();
    let cache = ReadCache::new(Source {
        file,
        error: &io_error,
    });
    let data = &cache;
    let refuse = Refuse {
        path,
        file_size,
        io_error: &io_error,
    };

    let header = Header::parse(data).map_err(|e| refuse.header(e, data))?;
    let endian = header
        .endian()
        .map_err(|e| refuse.object(e, "ELF header"))?;
    if header.is_little_endian() != cfg!(target_endian = "little") {
        let (file, host) = if header.is_little_endian() {
            ("little-endian", "big-endian")
        } else {
            ("big-endian", "little-endian")
        };
        return Err(refuse.not_elf(format!("{file} byte order, this host is {host}")));
    }
    let e_type = header.e_type(endian);
    if e_type != elf::ET_DYN {
        let what = match e_type {
            elf::ET_REL => "a relocatable object",
            elf::ET_EXEC => "an executable",
            elf::ET_CORE => "a core dump",
            _ => "an unknown object type",
        };
        return Err(refuse.not_elf(format!(
            "object type {e_type} ({what}), expected a shared object ({})",
            elf::ET_DYN
        )));
    }
    let machine = header.e_machine(endian);
    if let Some((host, host_name)) = HOST_MACHINE {
        if machine != host {
            return Err(refuse.not_elf(format!(
                "machine {machine} ({}), this host is {host_name}",
                machine_name(machine)
            )));
        }
    }

    let shoff = header.e_shoff(endian);
    let shentsize = header.e_shentsize(endian);
    // With more than 0xfffe program headers the count is section 0's `sh_info`.
    let section_0 = |e| {
        refuse.table::<SectionHeader64<Endianness>>(e, "section header table", shoff, 1, shentsize)
    };
    let phnum = header.phnum(endian, data).map_err(section_0)?;

    // The program header table and the PT_LOAD segments: what `dlopen` maps and touches.
    let program_headers = header.program_headers(endian, data).map_err(|e| {
        refuse.table::<ProgramHeader64<Endianness>>(
            e,
            "program header table",
            header.e_phoff(endian),
            phnum.into(),
            header.e_phentsize(endian),
        )
    })?;
    if program_headers.is_empty() {
        return Err(refuse.not_elf("no program headers"));
    }
    for (index, segment) in program_headers.iter().enumerate() {
        if segment.p_type(endian) != elf::PT_LOAD {
            continue;
        }
        let (offset, size) = segment.file_range(endian);
        let end = offset.checked_add(size).ok_or_else(|| {
            refuse.not_elf(format!("PT_LOAD segment {index}: file range overflows"))
        })?;
        if end > file_size {
            return Err(refuse.past_end(format!("PT_LOAD segment {index}"), end));
        }
    }

    // With 0xff00 sections or more the count is section 0's `sh_size`.
    let shnum = header.shnum(endian, data).map_err(section_0)?;
    header.section_headers(endian, data).map_err(|e| {
        refuse.table::<SectionHeader64<Endianness>>(
            e,
            "section header table",
            shoff,
            shnum.into(),
            shentsize,
        )
    })?;

    // A shared object that exports no planner root module is not loaded at all: `dlopen`
    // would run its constructors in this process (another kvferry library in the same
    // directory, say the C API, would bring a second copy of everything). Decided from the
    // dynamic symbol table when there is one; without one, `dlopen` decides.
    if let Ok(sections) = header.sections(endian, data) {
        if let Ok(symbols) = sections.symbols(endian, data, elf::SHT_DYNSYM) {
            if !symbols.is_empty() {
                let root = abi_stable::library::ROOT_MODULE_LOADER_NAME.as_bytes();
                let exports_root = symbols.iter().any(|sym| {
                    sym.st_shndx(endian) != elf::SHN_UNDEF
                        && symbols.symbol_name(endian, sym).ok() == Some(root)
                });
                if !exports_root {
                    return Err(LoadError::NotAPlanner {
                        path: path.to_path_buf(),
                        symbol: abi_stable::library::ROOT_MODULE_LOADER_NAME.to_string(),
                    });
                }
            }
        }
    }
    Ok(())
}

fn read_error(path: &Path, e: &io::Error) -> LoadError {
    LoadError::Read {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// The file under the [`ReadCache`]. The cache reports a failed read as `Err(())`; the I/O
/// error is kept in `error` so the refusal can say what went wrong.
struct Source<'e> {
    file: File,
    error: &'e OnceCell<io::Error>,
}

/// Keeps the first I/O error in `slot`.
fn keep<T>(slot: &OnceCell<io::Error>, result: io::Result<T>) -> Result<T, ()> {
    result.map_err(|e| {
        let _ = slot.set(e);
    })
}

impl ReadCacheOps for Source<'_> {
    fn len(&mut self) -> Result<u64, ()> {
        keep(self.error, self.file.metadata().map(|m| m.len()))
    }

    fn seek(&mut self, pos: u64) -> Result<u64, ()> {
        keep(self.error, Seek::seek(&mut self.file, SeekFrom::Start(pos)))
    }

    fn read(&mut self, buf: &mut [u8]) -> Result<usize, ()> {
        keep(self.error, Read::read(&mut self.file, buf))
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ()> {
        keep(self.error, Read::read_exact(&mut self.file, buf))
    }
}

/// Builds the [`LoadError`] for one file, turning `object`'s errors into the reason.
struct Refuse<'a> {
    path: &'a Path,
    file_size: u64,
    io_error: &'a OnceCell<io::Error>,
}

impl Refuse<'_> {
    fn not_elf(&self, detail: impl Into<String>) -> LoadError {
        LoadError::NotElf {
            path: self.path.to_path_buf(),
            detail: detail.into(),
        }
    }

    fn past_end(&self, part: impl Into<String>, end: u64) -> LoadError {
        LoadError::Truncated {
            path: self.path.to_path_buf(),
            part: part.into(),
            end,
            file_size: self.file_size,
        }
    }

    /// The I/O error behind a failed read, if there was one.
    fn io(&self) -> Option<LoadError> {
        self.io_error.get().map(|e| read_error(self.path, e))
    }

    /// `object` refused `part` for a reason this module does not explain further.
    fn object(&self, e: ObjectError, part: &str) -> LoadError {
        self.io()
            .unwrap_or_else(|| self.not_elf(format!("{part}: {e}")))
    }

    /// `object` refused the ELF header: says which identification field is wrong, or that
    /// the file is too short to hold the header.
    fn header<'d>(&self, e: ObjectError, data: impl ReadRef<'d>) -> LoadError {
        if let Some(error) = self.io() {
            return error;
        }
        match data.read_bytes_at(0, self.file_size.min(4)) {
            Ok(magic) if magic == elf::ELFMAG => {}
            Ok(_) => return self.not_elf("bad magic"),
            Err(()) => return self.object(e, "ELF header"),
        }
        let header_size = size_of::<Header>() as u64;
        if self.file_size < header_size {
            return self.past_end("ELF header", header_size);
        }
        // The raw header, without `object`'s validation, to say what is wrong with it.
        let Ok(raw) = data.read_at::<Header>(0) else {
            return self.object(e, "ELF header");
        };
        let ident = raw.e_ident();
        if ident.class != elf::ELFCLASS64 {
            self.not_elf(format!(
                "ELF class {}, expected 64-bit ({})",
                ident.class,
                elf::ELFCLASS64
            ))
        } else if ident.data != elf::ELFDATA2LSB && ident.data != elf::ELFDATA2MSB {
            self.not_elf(format!("unknown byte order {}", ident.data))
        } else if ident.version != elf::EV_CURRENT {
            self.not_elf(format!(
                "ELF version {}, expected {}",
                ident.version,
                elf::EV_CURRENT
            ))
        } else {
            self.object(e, "ELF header")
        }
    }

    /// `object` could not read the table of `count` entries of `T` that the header places at
    /// `offset` with entries of `entsize` bytes: reports the table as running past the end of
    /// the file where it does, else `object`'s reason.
    fn table<T>(
        &self,
        e: ObjectError,
        part: &str,
        offset: u64,
        count: u64,
        entsize: u16,
    ) -> LoadError {
        if let Some(error) = self.io() {
            return error;
        }
        if usize::from(entsize) == size_of::<T>() {
            match count
                .checked_mul(u64::from(entsize))
                .and_then(|len| len.checked_add(offset))
            {
                None => return self.not_elf(format!("{part} offset overflows")),
                Some(end) if end > self.file_size => return self.past_end(part, end),
                Some(_) => {}
            }
        }
        self.not_elf(format!("{part}: {e} (entry size {entsize})"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_io_error_while_reading_the_headers_is_a_read_error() {
        // A directory opens like a file on Linux, but reading it fails (EISDIR). An entry in
        // it gives it a non-zero size on every file system, so a read is attempted.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("an-entry-with-a-longish-name"), b"x").unwrap();
        let error = check(dir.path()).unwrap_err();
        assert!(
            matches!(&error, LoadError::Read { path, message }
                if path == dir.path() && message.contains("directory")),
            "{error:?}"
        );
    }

    #[test]
    fn an_empty_file_is_not_elf() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let error = check(file.path()).unwrap_err();
        assert_eq!(
            error,
            LoadError::NotElf {
                path: file.path().to_path_buf(),
                detail: "bad magic".into(),
            }
        );
    }
}
