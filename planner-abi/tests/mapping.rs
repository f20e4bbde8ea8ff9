//! The deployment shorthand: `Mapping`'s `FromStr` and `Display` agree.

use kvferry_planner_abi::Mapping;

fn m(tp: u32, pp: u32, cp: u32, moe_tp: u32, moe_ep: u32, adp: bool) -> Mapping {
    Mapping {
        tp,
        pp,
        cp,
        moe_tp,
        moe_ep,
        attention_dp: adp,
    }
}

fn parse(s: &str) -> Mapping {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

#[test]
fn parses_the_usual_shorthands() {
    assert_eq!(parse("tp4"), m(4, 1, 1, 4, 1, false));
    assert_eq!(parse("tp4pp2"), m(4, 2, 1, 4, 1, false));
    assert_eq!(parse("tp2cp4"), m(2, 1, 4, 2, 1, false));
    assert_eq!(parse("dep8"), m(8, 1, 1, 8, 1, true));
    assert_eq!(parse("dep8ep8"), m(8, 1, 1, 1, 8, true));
    assert_eq!(parse("TP8EP4"), m(8, 1, 1, 2, 4, false));
    assert_eq!(parse("pp2"), m(1, 2, 1, 1, 1, false));
    assert_eq!(parse(" tp2 "), m(2, 1, 1, 2, 1, false));
}

#[test]
fn round_trips_through_display() {
    for s in [
        "tp4", "tp4pp2", "tp2cp4", "dep8", "dep8ep8", "tp8ep2", "tp1",
    ] {
        let mapping = parse(s);
        assert_eq!(mapping.to_string(), s);
        assert_eq!(parse(&mapping.to_string()), mapping);
    }
}

#[test]
fn refuses_bad_specs_naming_the_problem() {
    let cases = [
        ("", "empty"),
        ("tp", "has no size"),
        ("xx4", "unknown axis \"xx\""),
        ("tp0", "tp size is 0"),
        ("tp2tp4", "tp given twice"),
        ("tp4dep4", "tp and dep both given"),
        ("tp4ep3", "ep 3 does not divide tp 4"),
        ("tp4moetp4ep2", "must equal the tp width 4"),
        (
            "tp99999999999",
            "size 99999999999 of tp is too large (at most 4294967295)",
        ),
    ];
    for (spec, needle) in cases {
        let err = spec.parse::<Mapping>().unwrap_err();
        assert_eq!(err.spec(), spec);
        let text = err.to_string();
        assert!(text.contains(needle), "{spec}: {text}");
    }
}
