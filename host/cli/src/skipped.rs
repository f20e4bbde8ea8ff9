//! Why `kvferry planners --all` skipped a file, in words a person reads.

use kvferry_loader::{LoadError, SkippedFile};

/// Why a file was skipped, after its path (which the reason's text starts with too): a
/// library without a planner's root module is named with abi_stable's readable name of the
/// symbol it lacks, not the mangled one the ELF file carries.
pub(crate) fn reason(s: &SkippedFile) -> String {
    if let LoadError::NotAPlanner { symbol, .. } = &s.reason {
        return format!(
            "not a planner: it exports no abi_stable root module (symbol `{}`)",
            abi_stable_demangled(symbol)
        );
    }
    let text = s.reason.to_string();
    let prefix = format!("{}: ", s.path.display());
    match text.strip_prefix(&prefix) {
        Some(rest) => rest.to_string(),
        None => text,
    }
}

/// An abi_stable symbol name as it was written before mangling: the mangler keeps
/// alphanumeric characters and writes every other as `_` and a code
/// (`_1as_0lib_1header_0root_bmodule_bloader` is `_as.lib_header.root module loader`). A
/// code it does not have is kept as it is.
fn abi_stable_demangled(symbol: &str) -> String {
    const CODES: &[(char, char)] = &[
        ('0', '.'),
        ('1', '_'),
        ('2', '-'),
        ('3', '<'),
        ('4', '>'),
        ('5', '('),
        ('6', ')'),
        ('7', '['),
        ('8', ']'),
        ('9', '{'),
        ('a', '}'),
        ('b', ' '),
        ('c', ','),
        ('d', ':'),
        ('e', ';'),
        ('f', '!'),
        ('g', '#'),
        ('h', '$'),
        ('i', '%'),
        ('j', '/'),
        ('k', '='),
        ('l', '?'),
        ('m', '¿'),
        ('o', '¡'),
        ('p', '*'),
        ('q', '+'),
        ('r', '~'),
        ('s', '|'),
        ('t', '°'),
        ('u', '¬'),
        ('x', '\''),
        ('y', '"'),
        ('z', '`'),
    ];
    let mut out = String::with_capacity(symbol.len());
    let mut chars = symbol.chars();
    while let Some(c) = chars.next() {
        if c != '_' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some(code) => match CODES.iter().find(|(k, _)| *k == code) {
                Some((_, plain)) => out.push(*plain),
                None => {
                    out.push('_');
                    out.push(code);
                }
            },
            None => out.push('_'),
        }
    }
    out
}
