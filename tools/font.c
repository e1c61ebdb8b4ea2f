/*
 * font.c -- a 5x7 bitmap font for the labels of `mha viz`, drawn for it:
 * the 95 printable ASCII characters ' '..'~' in order, 7 rows each, top
 * row first.  Each row is one base-32 digit ('0'..'9', 'A'..'V'): its 5
 * bits are the row's pixels, 16 the leftmost.  'A' is
 * .###. #...# #...# ##### #...# #...# #...#  ->  "EHHVHHH".
 */
#include "font.h"

static const char GLYPHS[] =
    "00000004444404AA00000AAVAVAA4FKE5U4OP248J3CIK8LID4480000"  /*  !"#$%&' */
    "2488842842224804LEL40044V4400000C48000V00000000CC01248G0"  /* ()*+,-./ */
    "EHJLPHE4C4444EEH1248VU11E11U26AIV22VGU11HE68GUHHEV124888"  /* 01234567 */
    "EHHEHHEEHHF12C0CC0CC00CC0C48248G84200V0V008421248EH12404"  /* 89:;<=>? */
    "EHNLNGEEHHVHHHUHHUHHUEHGGGHESIHHHISVGGUGGVVGGUGGGEHGNHHF"  /* @ABCDEFG */
    "HHHVHHHE44444E72222ICHIKOKIHGGGGGGVHRLLHHHHHPLJHHEHHHHHE"  /* HIJKLMNO */
    "UHHUGGGEHHHLIDUHHUKIHFGGE11UV444444HHHHHHEHHHHHA4HHHLLLA"  /* PQRSTUVW */
    "HHA4AHHHHA4444V1248GVE88888E0G84210E22222E4AH0000000000V"  /* XYZ[\]^_ */
    "842000000E1FHFGGMPHHU00EGGHE11DJHHF00EHVGE698S8880FHHF1E"  /* `abcdefg */
    "GGMPHHH40C444E20622ICGGIKOKIC44444E00QLLHH00MPHHH00EHHHE"  /* hijklmno */
    "00UHUGG00FHF1100MPGGG00EGE1U88S889600HHHJD00HHHA400HHLLA"  /* pqrstuvw */
    "00HA4AH00HHF1E00V248V244844244444448442448008L200";        /* xyz{|}~  */

unsigned tool_glyph_row(int c, int row)
{
    if (c < ' ' || c > '~')
        c = '?';
    if (row < 0 || row > 6)
        return 0;
    const char d = GLYPHS[(c - ' ') * 7 + row];
    return (unsigned)(d <= '9' ? d - '0' : d - 'A' + 10);
}
