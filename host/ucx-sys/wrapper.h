/* Everything ucx-sys binds comes from the public UCP header. */
#include <ucp/api/ucp.h>
