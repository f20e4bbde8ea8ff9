//! Byte counts for people: the exact count, and its size in binary units beside it.

/// `n` in binary units: `512 B`, `3.5 KiB`, `320 MiB`, `1.25 GiB` (three significant
/// figures at most, trailing zeros dropped).
pub fn size(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    let decimals = if value < 10.0 {
        2
    } else if value < 100.0 {
        1
    } else {
        0
    };
    let text = format!("{value:.decimals$}");
    let text = if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.')
    } else {
        &text
    };
    format!("{text} {}", UNITS[unit])
}

/// `n bytes`, with [`size`] beside it from 1 KiB up: `335544320 bytes (320 MiB)`.
pub fn bytes(n: u64) -> String {
    if n < 1024 {
        format!("{n} bytes")
    } else {
        format!("{n} bytes ({})", size(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(size(512), "512 B");
        assert_eq!(size(3584), "3.5 KiB");
        assert_eq!(size(335_544_320), "320 MiB");
        assert_eq!(size(1_342_177_280), "1.25 GiB");
        assert_eq!(size(1_447_034_880), "1.35 GiB");
        assert_eq!(size(u64::MAX), "16 EiB");
        assert_eq!(bytes(1000), "1000 bytes");
        assert_eq!(bytes(335_544_320), "335544320 bytes (320 MiB)");
    }
}
