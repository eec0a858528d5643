//! `flashsample!` rejects invalid pipelines at compile time, pointing at the offending tokens.
//! The cases live here, beside the macro, so trybuild builds only the macro and the IR.

#[test]
fn invalid_pipelines_fail_to_compile() {
    trybuild::TestCases::new().compile_fail("tests/trybuild/*.rs");
}
